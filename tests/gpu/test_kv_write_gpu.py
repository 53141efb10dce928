"""The one-launch FP8 KV write (models/kv_write_triton.py), compiled on the GPU: the same
page bytes as torch's path (``kv_quant.write_fp8`` for K and for V) on bf16 rows of very
different magnitudes, eagerly and replayed in a CUDA graph with new rows; and an FP8-KV
engine's tokens with the kernel switched on equal the engine's with it off, with and
without CUDA graphs.  The CPU half is tests/test_kv_write_triton.py."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from gpu_rows import spread_rows  # noqa: E402
from llama4_tiny import copy_prompts  # noqa: E402

import chunklocal  # noqa: E402
from chunklocal.kv_quant import FP8_KV_DTYPE, write_fp8  # noqa: E402
from chunklocal.models import kv_write_triton  # noqa: E402
from chunklocal.models.kv_write_triton import kv_write_available, write_kv_fp8  # noqa: E402

HEADS, HEAD_DIM, SLOTS = 8, 128, 16384  # Scout's KV heads per token


def kv_rows(t, seed):
    """k, v [t, HEADS, HEAD_DIM], strided like the fused projection's output."""
    qkv = spread_rows(t, 3 * HEADS * HEAD_DIM, seed, decades=3)
    return (qkv[:, HEADS * HEAD_DIM:2 * HEADS * HEAD_DIM].view(t, HEADS, HEAD_DIM),
            qkv[:, 2 * HEADS * HEAD_DIM:].view(t, HEADS, HEAD_DIM))


def caches():
    return [torch.zeros(SLOTS, HEADS, HEAD_DIM, dtype=FP8_KV_DTYPE, device="cuda")
            for _ in range(2)]


def torch_write(kc, vc, slots, k, v, ks, vs):
    write_fp8(kc, slots, k, ks)
    write_fp8(vc, slots, v, vs)


def same_pages(a, b):
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 2.5), (1e-3, 7.0)])
@pytest.mark.parametrize("t", [1, 151, 8192])
def test_the_kernel_gives_torchs_bytes(t, scales, monkeypatch):
    monkeypatch.setattr(kv_write_triton, "KV_WRITE_ENABLED", True)
    k, v = kv_rows(t, seed=t)
    assert kv_write_available(k, v)
    slots = torch.randperm(SLOTS, device="cuda")[:t]
    got, want = caches(), caches()
    write_kv_fp8(*got, slots, k, v, *scales)
    torch_write(*want, slots, k, v, *scales)
    same_pages(got, want)


def test_replayed_in_a_cuda_graph_with_new_rows(monkeypatch):
    monkeypatch.setattr(kv_write_triton, "KV_WRITE_ENABLED", True)
    t = 64
    k, v = kv_rows(t, seed=1)
    slots = torch.randperm(SLOTS, device="cuda")[:t]
    got = caches()
    write_kv_fp8(*got, slots, k, v, 0.5, 0.25)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_kv_fp8(*got, slots, k, v, 0.5, 0.25)
    new_k, new_v = kv_rows(t, seed=2)
    k.copy_(new_k)
    v.copy_(new_v)
    slots.copy_(torch.randperm(SLOTS, device="cuda")[:t])
    graph.replay()
    want = caches()
    torch_write(*want, slots, k, v, 0.5, 0.25)
    for cache, ref in zip(got, want, strict=True):
        assert torch.equal(cache[slots].view(torch.uint8), ref[slots].view(torch.uint8))


@pytest.mark.parametrize("t", [1, 151, 8192])
def test_the_16bit_kernel_gives_index_copys_pages(t, monkeypatch):
    """KV_WRITE_16BIT_ENABLED (on by default): a bf16 cache receives exactly the rows
    ``index_copy_`` stores, eagerly and replayed in a CUDA graph with new rows."""
    monkeypatch.setattr(kv_write_triton, "KV_WRITE_16BIT_ENABLED", True)
    k, v = kv_rows(t, seed=t + 3)
    assert kv_write_triton.kv_write_16bit_available(k, v)
    slots = torch.randperm(SLOTS, device="cuda")[:t]

    def bf16_caches():
        return [torch.zeros(SLOTS, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
                for _ in range(2)]

    got, want = bf16_caches(), bf16_caches()
    kv_write_triton.write_kv(*got, slots, k, v)
    want[0].index_copy_(0, slots, k)
    want[1].index_copy_(0, slots, v)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kv_write_triton.write_kv(*got, slots, k, v)
    new_k, new_v = kv_rows(t, seed=t + 4)
    k.copy_(new_k)
    v.copy_(new_v)
    slots.copy_(torch.randperm(SLOTS, device="cuda")[:t])
    graph.replay()
    assert torch.equal(got[0][slots], k) and torch.equal(got[1][slots], v)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("kv_dtype,switch,writer", [
    ("fp8", "KV_WRITE_ENABLED", "write_kv_fp8"),
    ("auto", "KV_WRITE_16BIT_ENABLED", "write_kv")], ids=["fp8", "16bit"])
def test_engine_tokens_equal_with_the_kernel(copy_model, graphs, kv_dtype, switch, writer,
                                             monkeypatch):
    """An engine's tokens with the kernel switched on equal its tokens with it off (FP8
    pages: torch's quantized writes; 16-bit pages: ``index_copy_``), and it was called."""
    prompts = copy_prompts([20, 63, 64, 65, 130, 200, 257, 300], seed=5, vocab=128)
    kwargs = dict(device="cuda", max_num_seqs=8, max_num_batched_tokens=512,
                  max_model_len=512, cuda_graphs=graphs, kv_cache_dtype=kv_dtype)
    monkeypatch.setattr(kv_write_triton, switch, False)
    want = chunklocal.LLM(copy_model, **kwargs).generate(prompts, max_new_tokens=24,
                                                          ignore_eos=True)
    monkeypatch.setattr(kv_write_triton, switch, True)
    calls = []
    real = getattr(kv_write_triton, writer)

    def counted(*args):
        calls.append(1)
        real(*args)

    monkeypatch.setattr(f"chunklocal.models.llama4.{writer}", counted)
    got = chunklocal.LLM(copy_model, **kwargs).generate(prompts, max_new_tokens=24,
                                                        ignore_eos=True)
    assert calls and got == want
