"""Per-request sampling through the engine (CPU float32, tiny random Llama-4).

Oracles: the engine's own greedy call for "equals greedy" checks (itself checked
against transformers in test_engine.py); transformers' logits for logprobs and for a
greedy loop with penalties applied by the per-token reference of test_engine_sampler.py.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from llama4_tiny import hf_logits, prompts_of
from test_engine_sampler import ref_penalties
from test_engine_threads import run_threads

import chunklocal
from chunklocal.engine.core import QueueFullError
from chunklocal.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py, as are ckpt, hold_steps


@pytest.fixture(scope="module")
def llm(ckpt):
    return chunklocal.LLM(ckpt[0], max_num_seqs=6, max_num_batched_tokens=64, max_model_len=128)


def tokens(outputs, i=0):
    return [o.outputs[i].token_ids for o in outputs]


def test_seed_reproducible_alone_and_beside_others_and_two_seeds_differ(llm):
    prompt, others = prompts_of([20], 1)[0], prompts_of([5, 33, 12, 50], 2)
    mine = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16)
    alone = tokens(llm.generate([prompt], mine))[0]
    again = tokens(llm.generate([prompt], mine))[0]
    mixed = [SamplingParams(temperature=0.7, max_tokens=9), SamplingParams(max_tokens=20),
             SamplingParams(temperature=0.0, max_tokens=7),
             SamplingParams(temperature=1.3, seed=99, max_tokens=16)]
    beside = llm.generate(others[:2] + [prompt] + others[2:], mixed[:2] + [mine] + mixed[2:])
    assert alone == again == tokens(beside)[2]
    other_seed = tokens(llm.generate([prompt], mine.replace(seed=1235)))[0]
    assert other_seed != alone
    greedy = llm.generate([prompt], max_new_tokens=16)[0]
    assert alone != greedy


def test_seeded_requests_from_several_threads(llm):
    prompts = prompts_of([7, 30, 18, 44], 3)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12) for s in range(4)]
    want = [tokens(llm.generate([p], q))[0] for p, q in zip(prompts, params, strict=True)]
    got = run_threads(lambda i: tokens(llm.generate([prompts[i]], params[i]))[0], 4)
    assert got == want


def test_top_k_1_and_temperature_0_are_greedy(llm):
    prompts = prompts_of([9, 25, 40], 4)
    greedy = llm.generate(prompts, max_new_tokens=12, ignore_eos=True)
    assert tokens(llm.generate(prompts, SamplingParams(temperature=1.0, top_k=1,
                                                       max_tokens=12))) == greedy
    assert tokens(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))) == greedy


def test_n_samples_share_the_prompt_and_use_seed_plus_index(llm):
    prompt = prompts_of([15], 5)[0]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=40, max_tokens=10))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert llm.last_stats.requests == 1 and llm.last_stats.new_tokens == 30
    for i in range(3):
        single = llm.generate([prompt], SamplingParams(temperature=1.0, seed=40 + i,
                                                       max_tokens=10))[0]
        assert out.outputs[i].token_ids == single.outputs[0].token_ids
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3


def test_logprobs_are_the_raw_model_distribution(llm, ckpt):
    _, hf = ckpt
    prompt = prompts_of([21], 6)[0]
    out = llm.generate([prompt], SamplingParams(temperature=1.0, seed=3, logprobs=4,
                                                max_tokens=6, repetition_penalty=1.3))[0]
    sample = out.outputs[0]
    assert len(sample.logprobs) == 6
    total = 0.0
    for j, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
        raw = torch.log_softmax(hf_logits(hf, prompt + sample.token_ids[:j])[-1].double(), -1)
        top = raw.topk(4).indices.tolist()
        assert set(entry) == set(top) | {token}
        for t, value in entry.items():
            assert value == pytest.approx(float(raw[t]), abs=1e-4)
        total += entry[token]
    assert sample.cumulative_logprob == pytest.approx(total, abs=1e-5)
    assert llm.generate([prompt], SamplingParams(max_tokens=2))[0].outputs[0].logprobs is None


def reference_greedy(hf, prompt, new, penalties, prompt_counts=True):
    out = []
    for _ in range(new):
        logits = hf_logits(hf, prompt + out)[-1].double().tolist()
        penalised = ref_penalties(logits, prompt if prompt_counts else [], out,
                                  penalties.get("repetition_penalty", 1.0),
                                  penalties.get("presence_penalty", 0.0),
                                  penalties.get("frequency_penalty", 0.0))
        out.append(max(range(len(penalised)), key=penalised.__getitem__))
    return out


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.8),
                                       dict(presence_penalty=1.5, frequency_penalty=0.8),
                                       dict(repetition_penalty=0.7, frequency_penalty=-0.5)])
def test_greedy_with_penalties_matches_a_reference_loop(llm, ckpt, penalties):
    """Greedy decoding with penalties == argmax of transformers' logits penalised by the
    per-token reference, token by token."""
    _, hf = ckpt
    start = prompts_of([20], 0)[0]
    # The prompt ends with its own greedy continuation: the tokens the model favours
    # are prompt tokens, so the repetition penalty's prompt part matters.
    prompt = start + llm.generate([start], max_new_tokens=10)[0]
    new = 10
    got = tokens(llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=new,
                                                       **penalties)))[0]
    want = reference_greedy(hf, prompt, new, penalties)
    assert got == want
    assert got != llm.generate([prompt], max_new_tokens=new)[0]  # penalties changed something
    if penalties.get("repetition_penalty", 1.0) > 1.0:  # and so did the prompt's tokens
        assert want != reference_greedy(hf, prompt, new, penalties, prompt_counts=False)


def test_generation_config_fills_unset_fields_only(ckpt, tmp_path):
    import shutil

    shutil.copytree(ckpt[0], tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 1.0, "top_k": 1, "max_new_tokens": 5, "do_sample": True}))
    prompt = prompts_of([14], 8)[0]
    auto = chunklocal.LLM(tmp_path, max_model_len=64)
    none = chunklocal.LLM(tmp_path, max_model_len=64, generation_config="none")
    greedy = auto.generate([prompt], max_new_tokens=5)[0]
    # top_k=1 from the file: greedy; max_new_tokens -> max_tokens 5
    assert tokens(auto.generate([prompt], SamplingParams(seed=1)))[0] == greedy
    # explicitly set fields win over the file
    explicit = tokens(auto.generate([prompt], SamplingParams(seed=1, top_k=0, max_tokens=5)))[0]
    assert explicit == tokens(none.generate([prompt], SamplingParams(seed=1, max_tokens=5)))[0]
    assert explicit != greedy
    assert len(tokens(none.generate([prompt], SamplingParams(seed=1)))[0]) == 16
    assert auto.generate([prompt], max_new_tokens=5, temperature=0.0)[0] == greedy
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'none'"):
        chunklocal.LLM(tmp_path, max_model_len=64, generation_config="sometimes")


def test_bad_requests_name_the_request_and_change_nothing(llm):
    core = llm.core
    with pytest.raises(ValueError, match=r"request r1: prompt of 100 tokens \+ max_tokens 40"):
        core.add_request([1] * 100, SamplingParams(max_tokens=40), request_id="r1")
    with pytest.raises(ValueError, match="request r2: token id 600 at index 1"):
        core.add_request([1, 600], SamplingParams(), request_id="r2")
    with pytest.raises(ValueError, match="request r3: stop strings .* need a tokenizer"):
        core.add_request([1, 2], SamplingParams(stop="x"), request_id="r3")
    with pytest.raises(ValueError, match="request r4: logprobs 21 exceeds the maximum 20"):
        core.add_request([1, 2], SamplingParams(logprobs=21), request_id="r4")
    with pytest.raises(ValueError, match="prompt 1: request .*: the prompt is empty|prompt 1"):
        llm.generate([[1, 2], []], SamplingParams())
    with pytest.raises(ValueError, match=r"request r5: prompt of 100 tokens \+ max_tokens 29"):
        core.add_request([1] * 100, SamplingParams(max_tokens=29), request_id="r5")
    fits = core.add_request([1] * 100, SamplingParams(max_tokens=28, ignore_eos=True))
    assert len(fits.result().outputs[0].token_ids) == 28
    long = core.add_request([1] * 100, SamplingParams(max_tokens=None, temperature=0.0))
    assert len(long.result().outputs[0].token_ids) == 28  # the room left in max_model_len
    unset = core.add_request([1] * 120, SamplingParams(temperature=0.0))  # default 16 > 8
    assert len(unset.result().outputs[0].token_ids) == 8
    assert unset.result().outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="request r6: prompt of 128 tokens leaves no room"):
        core.add_request([1] * 128, SamplingParams(), request_id="r6")
    assert core.stats()["num_waiting"] == 0 and core.stats()["kv_usage"] == 0.0


def test_the_waiting_limit_counts_sequences(ckpt):
    """max_waiting_requests counts prompts x n: one request of n = 3 is 3 sequences."""
    llm = chunklocal.LLM(ckpt[0], max_num_seqs=4, max_model_len=64, max_waiting_requests=2)
    with pytest.raises(QueueFullError, match="0 sequences are waiting and this request adds 3"):
        llm.core.add_request([1, 2], SamplingParams(n=3, max_tokens=2, seed=1))
    assert llm.core.stats()["num_waiting"] == 0
    out = llm.core.add_request([1, 2], SamplingParams(n=2, max_tokens=2, seed=1)).result()
    assert len(out.outputs) == 2


def test_queue_full_is_refused_not_hung(ckpt, hold_steps):
    llm = chunklocal.LLM(ckpt[0], max_num_seqs=1, max_model_len=64, max_waiting_requests=1)
    gate, entered = hold_steps(llm)  # conftest.py
    first = llm.core.add_request([1, 2, 3], SamplingParams(max_tokens=3))
    assert entered.wait(30)
    second = llm.core.add_request([4, 5], SamplingParams(max_tokens=3))
    with pytest.raises(QueueFullError, match="1 sequences are waiting and this request adds "
                       "1; the limit"):
        llm.core.add_request([6], SamplingParams(max_tokens=3))
    gate.set()
    assert len(first.result().outputs[0].token_ids) == 3
    assert len(second.result().outputs[0].token_ids) == 3
    core = llm.core
    running = core.add_request([7, 8], SamplingParams(max_tokens=60, ignore_eos=True))
    next(iter(running))
    core.shutdown()  # running requests end with "abort", the loop thread stops
    assert running.result().outputs[0].finish_reason == "abort"
    assert not core._thread.is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        core.add_request([6], SamplingParams(max_tokens=3))
    assert llm.core is not core  # llm.core starts a new one
    assert len(llm.generate([[6]], max_new_tokens=3)[0]) == 3


def test_speculative_decoding_leaves_every_kind_of_request_unchanged(ckpt):
    """k=3 prompt-lookup drafts (plain greedy requests only) against k=0, in one mixed
    batch: greedy with logprobs, greedy with penalties, seeded sampling, n=2."""
    path, _ = ckpt
    rng = random.Random(5)
    motif = [rng.randrange(512) for _ in range(6)]
    prompts = [(motif * 8)[:45], (motif * 6)[:33], (motif * 7)[:40], prompts_of([25], 9)[0],
               (motif * 5)[:28]]
    params = [SamplingParams(temperature=0.0, max_tokens=20, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, max_tokens=20, frequency_penalty=-2.0),
              SamplingParams(temperature=1.0, seed=8, max_tokens=20),
              SamplingParams(temperature=0.9, seed=2, n=2, max_tokens=20)]
    kwargs = dict(max_num_seqs=6, max_num_batched_tokens=64, max_model_len=128)
    k0 = chunklocal.LLM(path, **kwargs).generate(prompts, params)
    k3_llm = chunklocal.LLM(path, num_speculative_tokens=3, **kwargs)
    k3 = k3_llm.generate(prompts, params)
    assert k3_llm.last_stats.accepted_tokens > 0
    for a, b in zip(k0, k3, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    for x, y in zip(k0[0].outputs[0].logprobs, k3[0].outputs[0].logprobs, strict=True):
        assert x.keys() == y.keys()
        assert all(abs(x[t] - y[t]) < 1e-4 for t in x)


@pytest.mark.parametrize("fields, drafted", [
    (dict(temperature=0.0), True), (dict(temperature=0.0, logprobs=2), True),
    (dict(temperature=0.0, repetition_penalty=1.2), False),
    (dict(temperature=0.0, presence_penalty=0.5), False),
    (dict(temperature=0.0, frequency_penalty=-0.5), False),
    (dict(temperature=0.7), False), (dict(temperature=0.7, top_k=1), False)])
def test_only_plain_greedy_requests_are_drafted(fields, drafted):
    """A verify window's rows share one token history, so a penalty would see the wrong
    counts and a sampled row would not be a draw: neither is drafted."""
    from chunklocal.engine.block_manager import BlockManager, KVGroup
    from chunklocal.engine.scheduler import Scheduler
    from chunklocal.engine.sequence import Sequence
    from chunklocal.kv_spec import FullAttentionSpec

    group = KVGroup(FullAttentionSpec(4, 1, 8, torch.float32), 64)
    scheduler = Scheduler(BlockManager([group], 2, 64), 2, 64, 128, num_speculative_tokens=3)
    seq = Sequence(0, [1, 2, 3] * 5, SamplingParams(max_tokens=10, **fields), 1)
    assert bool(scheduler._draft(seq)) == drafted
