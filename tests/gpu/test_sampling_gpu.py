"""Sampling and the engine core on the GPU (issue 13).  Skips without CUDA or flashinfer.

- FlashInfer's sampler (unseeded rows) and the torch exponential race (seeded rows) draw
  from the same distribution as the float64 reference of test_engine_sampler.py (6 sigma
  over 200k draws) and never leave the kept set.
- A seed gives the same tokens for the same batch, run twice.
- Threads calling generate() each get their sequential greedy outputs, on the trained copy
  model (confident choices: bf16 batch composition does not flip them), CUDA graphs on.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("flashinfer")

from llama4_tiny import COPY_GEOMETRY, copy_prompts, write_tiny_llama4  # noqa: E402
from test_engine_sampler import ref_keep  # noqa: E402
from test_engine_threads import run_threads  # noqa: E402

import chunklocal  # noqa: E402
from chunklocal.engine.sampler import Sampler, sampling_row  # noqa: E402
from chunklocal.engine.sampling import SamplingParams  # noqa: E402

GEOMETRY = COPY_GEOMETRY


def fake_seqs(params, count):
    return [SimpleNamespace(params=params, sampling_row=sampling_row(params), generator=None,
                            token_ids=[0], num_prompt_tokens=1) for _ in range(count)]


@pytest.mark.parametrize("fields", [dict(temperature=0.7, top_k=20),
                                    dict(temperature=0.7, top_p=0.8),
                                    dict(temperature=1.0, top_k=30, top_p=0.9),
                                    dict(temperature=1.0, min_p=0.1),
                                    dict(temperature=1.0)], ids=str)
@pytest.mark.parametrize("path", ["flashinfer", "torch"])
def test_gpu_sampler_matches_the_reference_distribution(fields, path):
    vocab, draws = 64, 200_000
    logits = torch.linspace(3.0, -3.0, vocab, device="cuda")
    params = SamplingParams(**fields)
    sampler = Sampler("cuda", seed=11, use_flashinfer=path == "flashinfer")
    tokens = sampler(logits.expand(draws, vocab).contiguous(), fake_seqs(params, draws),
                     np.arange(draws)).tokens
    scaled = (logits.double().cpu() / params.temperature).tolist()
    keep, probs = ref_keep(scaled, params.top_k, params.top_p, params.min_p)
    order = sorted(keep, key=lambda t: -scaled[t])
    expected = np.zeros(vocab)
    expected[order] = np.array(probs[:len(order)]) / sum(probs[:len(order)])
    counts = np.bincount(tokens, minlength=vocab)
    assert set(np.flatnonzero(counts)) <= keep
    sigma = np.sqrt(draws * expected * (1 - expected)) + 1
    assert (np.abs(counts - draws * expected) < 6 * sigma).all(), (counts, expected * draws)


def test_gpu_seeded_rows_reproducible_and_distinct():
    vocab = 1000
    gen = torch.Generator("cuda").manual_seed(0)
    logits = torch.randn(8, vocab, device="cuda", generator=gen)
    draws = []
    for _ in range(2):
        seqs = [SimpleNamespace(params=p, sampling_row=sampling_row(p), generator=None,
                                token_ids=[0], num_prompt_tokens=1)
                for p in [SamplingParams(temperature=1.0, top_p=0.95, seed=s) for s in range(8)]]
        sampler = Sampler("cuda", seed=123)
        draws.append([sampler(logits, seqs, np.arange(8)).tokens.tolist() for _ in range(10)])
    assert draws[0] == draws[1]
    columns = np.array(draws[0]).T  # per seed: its 10 tokens
    assert len({tuple(c) for c in columns}) == 8


@pytest.fixture(scope="module")
def trained(copy_model):
    return copy_model


def test_gpu_engine_core_threads_equal_sequential_greedy(trained):
    llm = chunklocal.LLM(trained, device="cuda", max_num_seqs=8, max_num_batched_tokens=512,
                         max_model_len=512)
    calls = [copy_prompts([40 + 30 * i, 70, 150 + i], seed=i, vocab=128) for i in range(4)]
    want = [llm.generate(p, max_new_tokens=32, ignore_eos=True) for p in calls]
    for _ in range(3):
        got = run_threads(lambda i: llm.generate(calls[i], max_new_tokens=32, ignore_eos=True),
                          4, timeout=300)
        assert got == want
    assert llm.runner.graph_steps > 0
    assert all(g.num_free == g.num_blocks for g in llm.groups)


def test_gpu_seeded_generate_same_batch_twice_and_streams(tmp_path):
    write_tiny_llama4(tmp_path, seed=0, initializer_range=0.05, **GEOMETRY)
    llm = chunklocal.LLM(tmp_path, device="cuda", max_num_seqs=8, max_model_len=256)
    assert llm.runner.sampler.use_flashinfer
    prompts = [[i + 1] * (10 + 7 * i) for i in range(6)]
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=24) for i in
              range(3)] + [SamplingParams(temperature=0.8, top_k=40, max_tokens=24)] * 3
    runs = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)] for _ in range(2)]
    assert runs[0][:3] == runs[1][:3]  # seeded rows: same batch, same tokens
    assert all(len(t) == 24 and all(0 <= x < 512 for x in t) for t in runs[0])
    stream = llm.core.add_request(prompts[0], params[0])
    start = time.perf_counter()
    seen = list(stream)
    assert seen[-1].finished and len(seen[-1].outputs[0].token_ids) == 24
    assert seen[-1].metrics.time_to_first_token <= time.perf_counter() - start


def same_outputs(overlapped, sync, prompts) -> None:
    """Greedy and seeded sampled outputs of the overlapped engine equal the synchronous's."""
    assert overlapped.generate(prompts, max_new_tokens=40, ignore_eos=True) == \
        sync.generate(prompts, max_new_tokens=40, ignore_eos=True)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=40,
                             ignore_eos=True) for i in range(len(prompts))]
    got = [o.outputs[0].token_ids for o in overlapped.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in sync.generate(prompts, params)]


def test_gpu_async_scheduling_same_outputs_and_overlaps(trained):
    """async_scheduling on the GPU: CUDA-graph decode steps are launched with the previous
    step in flight, and outputs equal the synchronous loop's (greedy and seeded)."""
    kwargs = dict(device="cuda", max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512)
    sync = chunklocal.LLM(trained, async_scheduling=False, **kwargs)
    overlapped = chunklocal.LLM(trained, async_scheduling=True, **kwargs)
    launches, real = [], overlapped.runner.launch

    def counting(batch, prev=None):
        launches.append(prev is not None)
        return real(batch, prev)

    overlapped.runner.launch = counting
    same_outputs(overlapped, sync, copy_prompts([20, 63, 64, 65, 130, 200, 257, 300], seed=1,
                                                vocab=128))
    assert sum(launches) > 30
    assert all(g.num_free == g.num_blocks for g in overlapped.groups)


def test_gpu_async_scheduling_overlaps_eager_mixed_steps(trained):
    """CHUNKLOCAL_OVERLAP_EAGER's path (backends' ``overlaps_eager_steps``): eager steps
    that prefill a chunk beside decodes are launched with the previous step in flight --
    FlashInfer's plans staged in alternating wrappers, the inputs' copies queued behind
    the last step -- and outputs equal the synchronous loop's, greedy and seeded."""
    kwargs = dict(device="cuda", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512)
    sync = chunklocal.LLM(trained, async_scheduling=False, **kwargs)
    overlapped = chunklocal.LLM(trained, async_scheduling=True, **kwargs)
    for backend in overlapped.runner.backends:
        backend.overlaps_eager_steps = True
    assert overlapped.runner.overlaps_eager
    mixed, real = [], overlapped.runner.launch

    def counting(batch, prev=None):
        mixed.append(prev is not None and max(batch.num_new) > 1 and min(batch.num_new) == 1)
        return real(batch, prev)

    overlapped.runner.launch = counting
    # prompts of 20-300 tokens in 64-token steps: most steps carry a prefill chunk beside
    # the decodes of the requests admitted before it
    same_outputs(overlapped, sync, copy_prompts([20, 63, 64, 65, 130, 200, 257, 300], seed=2,
                                                vocab=128))
    assert sum(mixed) > 10, sum(mixed)
    assert all(g.num_free == g.num_blocks for g in overlapped.groups)
