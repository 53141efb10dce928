"""Tensor parallelism on 2 GPUs (NCCL): TP=2 against TP=1 on the trained copy-task model.

The trained model's greedy choices are confident (see test_engine_gpu.py), so two
engines that compute the same function must agree token by token.  float32 with the
torch attention backend: every token equal and prompt logits within 1e-4 (relative
max error, as the CPU acceptance).  bf16 with FlashInfer, CUDA graphs on and off:
the ranks' partial sums are rounded to bf16 before the all-reduce, one more rounding
than TP=1 makes, so at least 98% of free-running tokens must agree (printed).
Skips without two CUDA GPUs or without flashinfer.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                  reason="needs 2 CUDA GPUs")]
pytest.importorskip("flashinfer")

from llama4_tiny import COPY_GEOMETRY, copy_prompts, rel_err  # noqa: E402

import chunklocal  # noqa: E402
from chunklocal.engine.workers import WorkerError  # noqa: E402

GEOMETRY = COPY_GEOMETRY
LENGTHS = [20, 63, 64, 65, 130, 200, 257, 300]
NEW = 24


def engine(path, **kwargs):
    return chunklocal.LLM(path, device="cuda", max_num_seqs=8, max_num_batched_tokens=512,
                          max_model_len=512, **kwargs)


def same_fraction(outs_a, outs_b):
    pairs = [(x, y) for a, b in zip(outs_a, outs_b, strict=True)
             for x, y in zip(a, b, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


@pytest.fixture(scope="module")
def trained(copy_model):
    return copy_model


def test_float32_two_ranks_equal_one(trained):
    prompts = copy_prompts(LENGTHS, seed=1, vocab=128)
    kw = dict(dtype=torch.float32, attention_backend="torch")
    ref = engine(trained, **kw)
    want, want_logits = (ref.generate(prompts, NEW, ignore_eos=True),
                         ref.prompt_logits(prompts))
    del ref
    for moe in ("tp", "ep"):
        with engine(trained, tensor_parallel_size=2, moe_parallel=moe, **kw) as llm:
            assert llm.generate(prompts, NEW, ignore_eos=True) == want, moe
            for i, (got, exp) in enumerate(zip(llm.prompt_logits(prompts), want_logits,
                                               strict=True)):
                assert rel_err(got, exp) <= 1e-4, (moe, i)


def test_two_ranks_size_their_pools_by_gpu_memory_utilization(trained):
    """Each rank takes its baseline, loads its slices and profiles the largest step with its
    peer (engine/workers.py); the pools follow the rank with the least room and every GPU
    stays under the fraction of its total memory."""
    u = 0.2
    torch.cuda.empty_cache()
    used_before = [torch.cuda.mem_get_info(r)[1] - torch.cuda.mem_get_info(r)[0]
                   for r in range(2)]
    with chunklocal.LLM(trained, device="cuda", tensor_parallel_size=2, max_num_seqs=8,
                        max_num_batched_tokens=512, max_model_len=1 << 16,
                        gpu_memory_utilization=u) as llm:
        budget = llm.memory_budget
        assert budget is not None and budget.weights > 0 and budget.activations > 0
        assert llm.kv_pools.total_bytes <= budget.requested - budget.weights - budget.reserved
        prompts = copy_prompts(LENGTHS, seed=2, vocab=128)
        assert len(llm.generate(prompts, 8, ignore_eos=True)) == len(prompts)
        for rank in range(2):  # what each device gained, the workers' processes included
            free, total = torch.cuda.mem_get_info(rank)
            grown = total - free - used_before[rank]
            assert grown <= u * total + (1 << 30), (rank, grown / 2**30)  # CUDA + NCCL


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_bf16_two_ranks_match_one(trained, graphs, moe):
    prompts = copy_prompts(LENGTHS, seed=1, vocab=128)
    ref = engine(trained, cuda_graphs=graphs)
    want = ref.generate(prompts, NEW, ignore_eos=True)
    del ref
    with engine(trained, tensor_parallel_size=2, cuda_graphs=graphs, moe_parallel=moe) as llm:
        got = llm.generate(prompts, NEW, ignore_eos=True)
        graph_steps = llm.runner.graph_steps
    agree = same_fraction(got, want)
    print(f"\nTP=2 ({moe}, graphs {graphs}) = TP=1 on {agree:.1%} of free-running tokens; "
          f"graph steps {graph_steps}")
    assert (graph_steps > 0) == graphs
    assert agree >= 0.98


def test_a_killed_rank_ends_every_worker_nccl(trained):
    llm = engine(trained, tensor_parallel_size=2)
    pids = llm.workers.pids
    killed_at = []

    def kill():
        while len(llm.runner.tokens_per_step) < 3:
            time.sleep(0.01)
        killed_at.append(time.monotonic())
        os.kill(pids[1], signal.SIGKILL)

    threading.Thread(target=kill, daemon=True).start()
    prompts = copy_prompts([30] * 4, seed=2, vocab=128)
    with pytest.raises(WorkerError, match="rank 1 .*killed by signal 9"):
        llm.generate(prompts, max_new_tokens=400, ignore_eos=True)
    assert time.monotonic() - killed_at[0] < 30
    for pid in pids:  # rank 0 was blocked in an NCCL all-reduce: it had to be killed
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(
            ")")[1].split()[0] == "Z"
