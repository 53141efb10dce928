"""gpu_memory_utilization on the GPU (engine/memory.py): weights + KV + activations (+ CUDA
graphs) stay under the fraction of the device's total memory once the engine is built and
after a step of the largest shape, and the KV pools take what the profile leaves (the CPU
tests, tests/test_engine_memory.py, run the same procedure against a fake device)."""

from __future__ import annotations

import gc

import pytest
import torch
from llama4_tiny import COPY_GEOMETRY, write_tiny_llama4

import chunklocal

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GIB = 2**30


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    """The copy models' geometry (head_dim 128: FlashInfer has no kernels for the default
    16), with room for long requests, so the budget (not max_num_seqs whole requests)
    bounds the pools."""
    path = tmp_path_factory.mktemp("llama4_memory_gpu")
    write_tiny_llama4(path, seed=0, max_position_embeddings=1 << 20, **COPY_GEOMETRY)
    return path


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
def test_the_engine_stays_under_the_fraction_of_total_memory(path, cuda_graphs):
    gc.collect()  # earlier tests' engines in reference cycles would be freed mid-test
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    free0, total = torch.cuda.mem_get_info()
    before = torch.cuda.memory_allocated()
    u = min(0.1, round(0.8 * free0 / total, 2))  # a fraction the device has free now
    tokens = 4096
    llm = chunklocal.LLM(path, device="cuda", gpu_memory_utilization=u, max_num_seqs=64,
                         max_num_batched_tokens=tokens, max_model_len=1 << 20,
                         cuda_graphs=cuda_graphs)
    budget, pools = llm.memory_budget, llm.kv_pools
    limit = u * total
    print(f"\n{u=}: weights {budget.weights / GIB:.3f} GiB, activations "
          f"{budget.activations / GIB:.3f}, graphs {budget.graphs / GIB:.3f}, outside torch "
          f"{budget.outside_torch / GIB:.3f}, KV {pools.total_bytes / GIB:.3f} of "
          f"{limit / GIB:.2f} GiB")
    assert budget.total == total and budget.weights > 0 and budget.activations > 0
    assert (budget.graphs > 0) == llm.cuda_graphs
    # The budget binds (not max_num_seqs whole requests), and is spent to a page per pool.
    assert pools.groups[-1].pages < 64 * pools.groups[-1].need
    left = budget.requested - budget.weights - budget.reserved - pools.total_bytes
    assert 0 <= left < sum(g.page_bytes for g in pools.groups)
    built = torch.cuda.memory_allocated() - before
    assert built <= limit, (built / GIB, limit / GIB)
    assert torch.cuda.max_memory_allocated() - before <= limit  # the profile included
    # A step of the largest shape: max_num_batched_tokens of prompts over 64 requests.
    torch.cuda.reset_peak_memory_stats()
    prompts = [[(7 * i + j) % 500 + 1 for j in range(tokens // 64)] for i in range(64)]
    llm.generate(prompts, max_new_tokens=4, ignore_eos=True)
    peak = torch.cuda.max_memory_allocated() - before
    assert peak <= limit, (peak / GIB, limit / GIB)
    # ... whose activations the profile did not under-estimate (by more than 5%).
    step = torch.cuda.max_memory_allocated() - before - built
    assert step <= 1.05 * (budget.activations + budget.graphs) + (16 << 20), (step, budget)
    # What the device reports in use grew by no more than the fraction (torch's cache and
    # memory outside torch included).
    torch.cuda.synchronize()
    used = (total - torch.cuda.mem_get_info()[0]) - (total - free0)
    assert used <= limit + (256 << 20), (used / GIB, limit / GIB)
    del llm
    torch.cuda.empty_cache()


def test_too_large_a_fraction_for_the_free_memory_is_refused(path):
    """vLLM's start-up check, before any weight loads."""
    free, total = torch.cuda.mem_get_info()
    hold = torch.empty(int(0.2 * total), dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.95 asks .* GiB is "
                                             r"free: pass gpu_memory_utilization <="):
            chunklocal.LLM(path, device="cuda", gpu_memory_utilization=0.95, max_model_len=512)
    finally:
        del hold
        torch.cuda.empty_cache()
