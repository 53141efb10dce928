"""The batched sampler (engine/sampler.py) and SamplingParams against independent
per-row references written with Python loops in float64."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from chunklocal.engine.sampler import Sampler, apply_penalties, sampling_row, top_k_top_p_min_p
from chunklocal.engine.sampling import SamplingParams, generation_config_defaults


def ref_penalties(logits, prompt, output, rep, pres, freq):
    """vLLM's penalties, one token at a time (float64)."""
    out = [float(x) for x in logits]
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in output:
        out[t] -= freq
    for t in set(output):
        out[t] -= pres
    return out


def ref_keep(logits, top_k, top_p, min_p):
    """Tokens that min_p, then top_k, then top_p (on the top-k renormalised
    distribution, fewest leading tokens reaching top_p) keep."""
    vocab = len(logits)
    m = max(logits)
    probs = [math.exp(x - m) for x in logits]
    total = sum(probs)
    probs = [p / total for p in probs]
    keep = {t for t in range(vocab) if probs[t] >= min_p * max(probs)}
    order = sorted(keep, key=lambda t: -logits[t])
    if top_k > 0:
        order = order[:top_k]
    mass = sum(probs[t] for t in order)
    kept, acc = [], 0.0
    for t in order:
        if acc >= top_p:
            break
        kept.append(t)
        acc += probs[t] / mass
    return set(kept), [probs[t] / mass for t in order]


@st.composite
def penalty_batches(draw):
    rows, vocab = draw(st.integers(1, 5)), draw(st.integers(2, 40))
    hist, prompts = [], []
    for _ in range(rows):
        n = draw(st.integers(0, 30))
        hist.append(draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)))
        prompts.append(draw(st.integers(0, n)))
    logits = draw(st.lists(st.lists(st.floats(-5, 5), min_size=vocab, max_size=vocab),
                           min_size=rows, max_size=rows))
    rep = draw(st.lists(st.floats(0.5, 2.0), min_size=rows, max_size=rows))
    pres = draw(st.lists(st.floats(-2, 2), min_size=rows, max_size=rows))
    freq = draw(st.lists(st.floats(-2, 2), min_size=rows, max_size=rows))
    return logits, hist, prompts, rep, pres, freq


@given(penalty_batches())
@settings(max_examples=150, deadline=None)
def test_penalties_match_a_per_token_reference(batch):
    logits, hist, prompts, rep, pres, freq = batch
    got = apply_penalties(torch.tensor(logits, dtype=torch.float64), hist,
                          np.array(prompts), np.array(rep), np.array(pres), np.array(freq))
    for i in range(len(logits)):
        want = ref_penalties(logits[i], hist[i][:prompts[i]], hist[i][prompts[i]:], rep[i],
                             pres[i], freq[i])
        np.testing.assert_allclose(got[i].numpy(), want, rtol=1e-12, atol=1e-12)


@given(st.integers(1, 4), st.integers(2, 30), st.data())
@settings(max_examples=150, deadline=None)
def test_top_k_top_p_min_p_keep_the_reference_set(rows, vocab, data):
    gen = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    logits = gen.normal(0, 2, (rows, vocab))
    top_k = np.array([data.draw(st.integers(0, vocab + 2)) for _ in range(rows)])
    top_p = np.array([data.draw(st.floats(0.05, 1.0)) for _ in range(rows)])
    min_p = np.array([data.draw(st.sampled_from([0.0, 0.01, 0.2, 0.9])) for _ in range(rows)])
    got = top_k_top_p_min_p(torch.tensor(logits, dtype=torch.float64), top_k, top_p, min_p)
    for i in range(rows):
        keep, cum = ref_keep(logits[i].tolist(), int(top_k[i]), top_p[i], min_p[i])
        # Skip rounding-level coincidences with the top_p boundary.
        sums = np.cumsum(cum)
        assume(np.abs(sums - top_p[i]).min() > 1e-9)
        assert set(np.flatnonzero(torch.isfinite(got[i]).numpy())) == keep
        np.testing.assert_array_equal(got[i][list(keep)].numpy(), logits[i][list(keep)])


def fake_seqs(params_list, histories=None):
    seqs = []
    for i, params in enumerate(params_list):
        hist = (histories or {}).get(i, [0])
        seqs.append(SimpleNamespace(params=params, sampling_row=sampling_row(params),
                                    generator=None, token_ids=list(hist), num_prompt_tokens=1))
    return seqs


@given(st.integers(1, 6), st.integers(0, 5), st.data())
@settings(max_examples=60, deadline=None)
def test_a_seeded_row_does_not_depend_on_its_batch(num_others, position, data):
    """Same logits row, same seed: the same tokens step after step, whatever else is in
    the batch (other seeded, unseeded and greedy rows, in any position)."""
    vocab = 50
    gen = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    row = torch.tensor(gen.normal(0, 1, vocab), dtype=torch.float32)
    mine = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1234)
    alone_sampler, alone = Sampler("cpu", seed=0), fake_seqs([mine])
    want = [int(alone_sampler(row[None], alone, np.array([0])).tokens[0]) for _ in range(6)]
    others = [SamplingParams(temperature=data.draw(st.sampled_from([0.0, 0.5, 1.0])),
                             seed=data.draw(st.one_of(st.none(), st.integers(0, 99))))
              for _ in range(num_others)]
    position = min(position, num_others)
    batch_params = others[:position] + [mine] + others[position:]
    seqs = fake_seqs(batch_params)
    sampler = Sampler("cpu", seed=data.draw(st.integers(0, 99)))
    logits = torch.tensor(gen.normal(0, 1, (len(seqs), vocab)), dtype=torch.float32)
    logits[position] = row
    got = [int(sampler(logits, seqs, np.arange(len(seqs))).tokens[position]) for _ in range(6)]
    assert got == want


def test_distribution_of_sampled_tokens():
    """top_k=3 / top_p / min_p at temperature 0.7: 40000 draws match the renormalised
    probabilities (6 sigma) and never leave the kept set."""
    vocab, draws = 12, 40000
    logits = torch.linspace(2.0, -2.0, vocab)
    for params in (SamplingParams(temperature=0.7, top_k=3),
                   SamplingParams(temperature=0.7, top_p=0.8),
                   SamplingParams(temperature=0.7, min_p=0.2),
                   SamplingParams(temperature=0.7, seed=5)):
        seqs = fake_seqs([params] * draws)
        if params.seed is not None:  # one generator drawn 40000 times
            seqs = fake_seqs([params])
            tokens = np.array([Sampler("cpu")(logits[None], seqs, np.array([0])).tokens[0]
                               for _ in range(4000)])
        else:
            tokens = Sampler("cpu", seed=3)(logits.expand(draws, vocab).contiguous(), seqs,
                                            np.arange(draws)).tokens
        scaled = (logits / 0.7).tolist()
        keep, probs = ref_keep(scaled, params.top_k, params.top_p, params.min_p)
        order = sorted(keep, key=lambda t: -scaled[t])
        expected = np.zeros(vocab)
        mass = sum(probs[:len(order)])
        expected[order] = np.array(probs[:len(order)]) / mass
        counts = np.bincount(tokens, minlength=vocab)
        assert set(np.flatnonzero(counts)) <= keep
        n = len(tokens)
        sigma = np.sqrt(n * expected * (1 - expected)) + 1
        assert (np.abs(counts - n * expected) < 6 * sigma).all(), (params, counts, expected)


def test_greedy_rows_take_the_penalised_argmax_and_logprobs_are_raw():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=2)
    seqs = fake_seqs([params], {0: [0, 3]})  # token 0 seen: 3.0 -> 1.5
    result = Sampler("cpu")(logits, seqs, np.array([0]))
    assert result.tokens.tolist() == [1]
    raw = torch.log_softmax(logits, dim=-1)[0]
    assert result.token_logprobs[0] == pytest.approx(float(raw[1]))
    assert result.topk_ids[0].tolist() == [0, 1]
    np.testing.assert_allclose(result.topk_logprobs[0], raw[:2].numpy(), rtol=1e-6)


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 1e-40])
def test_a_top_p_below_float32_keeps_the_top_token(top_p):
    """float32 turns 1e-300 into 0: the top token must still be kept (not token 0)."""
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1)) * 3
    seqs = fake_seqs([SamplingParams(temperature=1.0, top_p=top_p)] * 64)
    tokens = Sampler("cpu", seed=2)(logits, seqs, np.arange(64)).tokens
    assert tokens.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("rep", [1e-300, 1e-46, 1e300])
def test_extreme_repetition_penalties_stay_finite_and_pick_by_the_rule(rep):
    """A penalty under 1 pushes seen tokens up, over 1 down; overflow must neither give
    NaN nor inf logits, and the greedy choice follows the penalty's direction."""
    logits = torch.tensor([[1.0, 2.0, 0.5, 3.0]])
    seqs = fake_seqs([SamplingParams(temperature=0.0, repetition_penalty=rep)], {0: [2]})
    row = sampling_row(seqs[0].params)
    penalised = apply_penalties(logits, [[2]], np.array([1]), row[[4]], row[[5]], row[[6]])
    assert torch.isfinite(penalised).all()
    token = Sampler("cpu")(logits, seqs, np.array([0])).tokens[0]
    assert token == (2 if rep < 1 else 3)


@pytest.mark.parametrize("field, value, message", [
    ("n", 0, "n must be an integer >= 1"), ("temperature", -0.1, "temperature must be"),
    ("temperature", float("nan"), "temperature must be"), ("top_p", 0.0, "top_p must be"),
    ("top_k", -2, "top_k must be"), ("top_k", 2.5, "top_k must be"),
    ("min_p", 1.5, "min_p must be"), ("seed", -1, "seed must be"),
    ("max_tokens", 0, "max_tokens must be"), ("stop", [1], "stop must be"),
    ("stop", [""], "stop must be non-empty"), ("stop_token_ids", [-3], "stop_token_ids"),
    ("logprobs", -1, "logprobs must be"), ("repetition_penalty", 0.0, "repetition_penalty"),
    ("presence_penalty", 2.5, "presence_penalty"), ("frequency_penalty", "1", "frequency"),
    ("ignore_eos", 1, "ignore_eos must be True or False"),
])
def test_bad_sampling_params_name_the_field_and_value(field, value, message):
    with pytest.raises(ValueError, match=f"SamplingParams.{message}.*got {value!r}"
                       .replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        SamplingParams(**{field: value})


def test_sampling_params_track_fields_set_and_take_defaults(tmp_path):
    params = SamplingParams(temperature=0.5, stop="x")
    assert params.fields_set == {"temperature", "stop"} and params.stop == ("x",)
    filled = params.with_defaults({"temperature": 0.9, "top_p": 0.7, "max_tokens": 99})
    assert (filled.temperature, filled.top_p, filled.max_tokens) == (0.5, 0.7, 99)
    assert filled.fields_set == params.fields_set
    with pytest.raises(AttributeError):
        params.temperature = 2.0
    (tmp_path / "generation_config.json").write_text(
        '{"temperature": 0.6, "top_p": 0.9, "do_sample": true, "eos_token_id": [1, 2],'
        ' "max_new_tokens": 7}')
    assert generation_config_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9,
                                                    "max_tokens": 7}
    (tmp_path / "generation_config.json").write_text('{"top_p": 1.5}')
    with pytest.raises(ValueError, match="generation_config.json: SamplingParams.top_p"):
        generation_config_defaults(tmp_path)
