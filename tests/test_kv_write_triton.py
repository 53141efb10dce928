"""The one-launch FP8 KV write (models/kv_write_triton.py): its kernel in Triton's
interpreter, and the attention's call of it, on the CPU.  tests/gpu/test_kv_write_gpu.py
compares the pages' bytes with torch's path on the H200."""

from __future__ import annotations

import textwrap

import pytest
import torch
from llama4_tiny import DENSE_FP8_KV, write_tiny_llama4
from test_engine_flashinfer_cpu import motif_prompts
from test_kv_cache_fp8 import _set_scales
from test_moe_triton import run_in_interpreter

import chunklocal
from chunklocal.kv_quant import FP8_KV_DTYPE, write_fp8
from chunklocal.models import llama4
from chunklocal.models.kv_write_triton import reciprocal_f32

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import os
    os.environ["CHUNKLOCAL_KV_WRITE_TRITON"] = "1"
    import torch
    from chunklocal.models.kv_write_triton import (kv_write_available, reciprocal_f32,
                                                   write_kv_fp8)

    gen = torch.Generator().manual_seed(0)
    t, h, d, slots_total = 7, 3, 16, 40
    # rows strided like the fused projection's output (q, k and v side by side)
    qkv = torch.randn(t, 4 * h * d, generator=gen) * 300  # some past +-448 after scaling
    k = qkv[:, h * d:2 * h * d].view(t, h, d)
    v = qkv[:, 3 * h * d:].view(t, h, d)
    assert kv_write_available(k, v)
    assert not kv_write_available(k.transpose(1, 2), v.transpose(1, 2))
    slots = torch.randperm(slots_total, generator=gen)[:t]
    kc = torch.zeros(slots_total, h, d)
    vc = torch.zeros(slots_total, h, d)
    write_kv_fp8(kc, vc, slots, k, v, 0.37, 2.5)
    for cache, x, scale in ((kc, k, 0.37), (vc, v, 2.5)):
        want = (x * reciprocal_f32(scale)).clamp(-448.0, 448.0)
        assert torch.equal(cache[slots], want), (cache[slots] - want).abs().max()
        assert (cache[slots].abs() == 448.0).any()  # the clamp was exercised
        others = torch.ones(slots_total, dtype=torch.bool)
        others[slots] = False
        assert not cache[others].any()  # nothing written outside the slots
    write_kv_fp8(kc, vc, slots[:0], k[:0], v[:0], 1.0, 1.0)  # an empty step: no launch
    # the 16-bit cache's form: the rows as they are (no scale, no clamp), in their slots
    from chunklocal.models import kv_write_triton
    assert kv_write_triton.KV_WRITE_16BIT_ENABLED  # on by default
    kv_write_triton.KV_WRITE_16BIT_ENABLED = False
    assert not kv_write_triton.kv_write_16bit_available(k, v)
    kv_write_triton.KV_WRITE_16BIT_ENABLED = True
    kv_write_triton.KV_WRITE_ENABLED = False  # the FP8 form's switch is not this one's
    assert kv_write_triton.kv_write_16bit_available(k, v)
    assert not kv_write_triton.kv_write_available(k, v)
    kc.zero_(), vc.zero_()
    kv_write_triton.write_kv(kc, vc, slots, k, v)
    assert torch.equal(kc[slots], k) and torch.equal(vc[slots], v)
    assert (kc[slots].abs() > 448.0).any()  # not clamped
    assert not kc[others].any() and not vc[others].any()
    print("ok")
""")


def test_kv_write_kernel_in_interpreter():
    run_in_interpreter(SCRIPT)


def test_reciprocal_is_float32():
    """torch's CUDA ``x / s`` for a Python scalar multiplies by float32(1 / float32(s))."""
    r = reciprocal_f32(0.37)
    assert r == float(torch.tensor(1.0) / torch.tensor(0.37))
    assert r != 1 / 0.37


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4_kv_write")
    write_tiny_llama4(path, **DENSE_FP8_KV)
    return path


def test_attention_calls_the_kernel_with_each_cache_and_scale(ckpt, monkeypatch):
    """With the kernel available, Attention.attend hands it the flat caches, the slots, K,
    V and their scales in that order: a stand-in with the kernel's contract (torch's write,
    per cache) gives the same tokens as the engine's own path, and it ran every layer."""
    kw = dict(max_num_seqs=4, max_num_batched_tokens=48, max_model_len=160,
              num_kv_blocks=64, kv_cache_dtype="fp8", dtype=torch.float32,
              attention_backend="torch")
    prompts = motif_prompts(3)

    def with_scales(llm):
        _set_scales(llm, 0.5, 0.125)  # non-unit and unequal: a swap would show
        return llm

    want = with_scales(chunklocal.LLM(ckpt, **kw)).generate(prompts, max_new_tokens=12)
    calls = []

    def standin(flat_k, flat_v, slots, k, v, k_scale, v_scale):
        assert flat_k.dtype == flat_v.dtype == FP8_KV_DTYPE
        assert flat_k.is_contiguous() and flat_k.shape[1:] == k.shape[1:] == v.shape[1:]
        assert slots.shape == (k.shape[0],) and not slots.dtype.is_floating_point
        calls.append(k.shape[0])
        write_fp8(flat_k, slots, k, k_scale)
        write_fp8(flat_v, slots, v, v_scale)

    monkeypatch.setattr(llama4, "kv_write_available", lambda k, v: True)
    monkeypatch.setattr(llama4, "write_kv_fp8", standin)
    llm = with_scales(chunklocal.LLM(ckpt, **kw))
    assert llm.generate(prompts, max_new_tokens=12) == want
    layers = len(llm.model.layers)
    assert len(calls) >= layers and len(calls) % layers == 0


def test_attention_calls_the_16bit_kernel_with_each_cache(ckpt, monkeypatch):
    """A 16-bit cache with KV_WRITE_16BIT_ENABLED: Attention.attend hands write_kv the flat
    caches, the slots, K and V in that order -- a stand-in with its contract
    (``index_copy_`` per cache) gives the engine's own tokens -- every layer, every step."""
    kw = dict(max_num_seqs=4, max_num_batched_tokens=48, max_model_len=160,
              num_kv_blocks=64, dtype=torch.float32, attention_backend="torch")
    prompts = motif_prompts(3)
    want = chunklocal.LLM(ckpt, **kw).generate(prompts, max_new_tokens=12)
    calls = []

    def standin(flat_k, flat_v, slots, k, v):
        assert flat_k.dtype == flat_v.dtype == torch.float32
        assert flat_k.is_contiguous() and flat_k.shape[1:] == k.shape[1:] == v.shape[1:]
        assert slots.shape == (k.shape[0],) and not slots.dtype.is_floating_point
        calls.append(k.shape[0])
        flat_k.index_copy_(0, slots, k)
        flat_v.index_copy_(0, slots, v)

    from chunklocal.models import kv_write_triton

    monkeypatch.setattr(kv_write_triton, "KV_WRITE_16BIT_ENABLED", True)
    monkeypatch.setattr(llama4, "kv_write_16bit_available", lambda k, v: True)
    monkeypatch.setattr(llama4, "write_kv", standin)
    llm = chunklocal.LLM(ckpt, **kw)
    assert llm.generate(prompts, max_new_tokens=12) == want
    layers = len(llm.model.layers)
    assert len(calls) >= layers and len(calls) % layers == 0


def test_the_kernel_is_on_by_default_and_needs_a_gpu():
    """On unless CHUNKLOCAL_KV_WRITE_TRITON=0 (the twelfth session's H200 run measured it);
    CPU tensors never reach it."""
    from chunklocal.models import kv_write_triton

    assert kv_write_triton.KV_WRITE_ENABLED
    k = torch.zeros(3, 8, 128)
    assert not kv_write_triton.kv_write_available(k, k)
