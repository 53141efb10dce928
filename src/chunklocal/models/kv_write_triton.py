"""The KV write in one Triton kernel: K and V (FP8 pages: quantized) scattered into their pages.

With an FP8 KV cache (``kv_cache_dtype="fp8"``) each layer's write path in torch is
:func:`chunklocal.kv_quant.write_fp8` for K and for V: cast to float32, scale, clamp, cast to
e4m3, ``index_copy_``: five launches each, ten per layer where a bf16 cache takes two. At
decode sizes every launch costs a few microseconds whatever its size, and on the H200 the
FP8-KV decode step of full-size Scout was 1.9-3.1% slower than the bf16-KV one at the same
batch (BENCHMARKS.md, eleventh session), about what 48 x 8 extra launches cost.
:func:`write_kv_fp8` does both writes in one launch: one program per token row reads its K
and V heads once and stores them quantized at the row's slot.

Its arithmetic is torch's on CUDA: ``x.float() / scale`` with a Python scalar runs as
``x * (1 / scale)``, the reciprocal rounded to float32 once on the host
(``div_true_kernel_cuda``), which :func:`write_kv_fp8` passes; the clamp to +-448 is exact;
the cast rounds to nearest even on both (``cvt.rn.satfinite`` on sm90).
tests/gpu/test_kv_write_gpu.py compares the pages' bytes with torch's path on the H200.
Triton's interpreter casts to e4m3 wrongly (it can lose an exponent step), so the CPU test
runs the kernel into a float32 "cache", which checks everything but that cast.

On by default since the twelfth session's H200 run (``CHUNKLOCAL_KV_WRITE_TRITON=0`` turns it
off): its pages' bytes equalled torch's at 1, 151 and 8192 rows and in a CUDA graph, the
engine's tokens held, and full-size Scout FP8 with FP8 KV at batch 144 stepped in 45.7 ms
against 46.6 ms through torch's writes (0.5% from the bf16-KV step of the same run;
BENCHMARKS.md).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from chunklocal.kv_quant import FP8_MAX
from chunklocal.models.quant_triton import available, pdl_args, triton

if triton is not None:
    import triton.language as tl

    from chunklocal.models.quant_triton import pdl_start

#: The switch, read at import (``CHUNKLOCAL_KV_WRITE_TRITON=0`` turns it off).
KV_WRITE_ENABLED = os.environ.get("CHUNKLOCAL_KV_WRITE_TRITON", "1") == "1"
#: The same kernel for a 16-bit cache (:func:`write_kv`: no scale, no clamp), in place of
#: the two ``index_copy_`` a layer: at a full-size Scout FP8 8k prefill step torch's index
#: kernels took 9.3 ms of 415 for the K/V writes and the MoE's unpermute, at about a tenth
#: of the copy rate (BENCHMARKS.md, fourteenth session), and a decode step launches two a
#: layer.  On since the fifteenth session's H200 run (engine tokens equal to
#: ``index_copy_``'s; with moe.GATHER_QUANT and SILU_QUANT the 8k / 32k prefill 2% faster);
#: off with ``CHUNKLOCAL_KV_WRITE_TRITON_16BIT=0`` (tests/gpu/test_kv_write_gpu.py).
KV_WRITE_16BIT_ENABLED = os.environ.get("CHUNKLOCAL_KV_WRITE_TRITON_16BIT", "1") == "1"
MAX_ROW = 16384  # kv heads x head_dim of one token in one block (Scout: 8 x 128)


def _rows_ok(x: torch.Tensor) -> bool:
    """[T, heads, head_dim] with each token's heads contiguous (rows may be strided)."""
    return (x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and x.shape[1] * x.shape[2] <= MAX_ROW)


def _kernel_runs(k: torch.Tensor, v: torch.Tensor) -> bool:
    """The kernel runs on ``k`` and ``v`` (either form)."""
    return available(k) and k.shape == v.shape and _rows_ok(k) and _rows_ok(v)


def kv_write_available(k: torch.Tensor, v: torch.Tensor) -> bool:
    """:func:`write_kv_fp8` runs on ``k`` and ``v`` and is switched on."""
    return KV_WRITE_ENABLED and _kernel_runs(k, v)


def kv_write_16bit_available(k: torch.Tensor, v: torch.Tensor) -> bool:
    """:func:`write_kv` runs on ``k`` and ``v`` and is switched on (its own switch: the FP8
    form's off does not turn this one off)."""
    return KV_WRITE_16BIT_ENABLED and _kernel_runs(k, v)


def reciprocal_f32(scale: float) -> float:
    """``1 / scale`` as torch's CUDA division by a Python scalar computes it: in float32."""
    return float(np.float32(1.0) / np.float32(scale))


if triton is not None:
    @triton.jit(do_not_specialize=["inv_k", "inv_v"])
    def _write_kv_kernel(k_ptr, v_ptr, slots_ptr, kc_ptr, vc_ptr, inv_k, inv_v, N,
                         stride_k, stride_v, QUANT: tl.constexpr, LIMIT: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        slot = tl.load(slots_ptr + row).to(tl.int64)
        k = tl.load(k_ptr + row * stride_k + cols, mask=mask, other=0.0)
        v = tl.load(v_ptr + row * stride_v + cols, mask=mask, other=0.0)
        if QUANT:  # FP8 pages: scaled and clamped in float32 (see the module docstring)
            k = tl.minimum(tl.maximum(k.to(tl.float32) * inv_k, -LIMIT), LIMIT)
            v = tl.minimum(tl.maximum(v.to(tl.float32) * inv_v, -LIMIT), LIMIT)
        tl.store(kc_ptr + slot * N + cols, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc_ptr + slot * N + cols, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_fp8(flat_k: torch.Tensor, flat_v: torch.Tensor, slots: torch.Tensor,
                 k: torch.Tensor, v: torch.Tensor, k_scale: float, v_scale: float) -> None:
    """``flat_k[slots] = quantize(k, k_scale)`` and the same for V, in one launch.

    ``flat_k`` / ``flat_v``: the caches as contiguous ``[slots, heads, head_dim]``;
    ``slots`` [T] (every slot valid: padding rows write the scratch page); ``k`` / ``v``
    [T, heads, head_dim] (:func:`kv_write_available`).  Clamping to +-448 is part of the
    kernel, so a float32 cache (the CPU test) receives exactly what is then cast.
    """
    _launch(flat_k, flat_v, slots, k, v, (reciprocal_f32(k_scale), reciprocal_f32(v_scale)))


def write_kv(flat_k: torch.Tensor, flat_v: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """``flat_k[slots] = k`` and ``flat_v[slots] = v`` (cast to the caches' dtype, as
    ``index_copy_(0, slots, k.to(...))`` stores them) in one launch; the arguments as
    :func:`write_kv_fp8`'s (:func:`kv_write_16bit_available`)."""
    _launch(flat_k, flat_v, slots, k, v, None)


def _launch(flat_k, flat_v, slots, k, v, inverse_scales: tuple[float, float] | None) -> None:
    rows, heads, head_dim = k.shape
    if rows == 0:
        return
    n = heads * head_dim
    assert flat_k.is_contiguous() and flat_v.is_contiguous() and flat_k[0].numel() == n
    inv_k, inv_v = inverse_scales or (1.0, 1.0)
    _write_kv_kernel[(rows,)](k, v, slots, flat_k, flat_v, inv_k, inv_v, n, k.stride(0),
                              v.stride(0), QUANT=inverse_scales is not None, LIMIT=FP8_MAX,
                              BLOCK=triton.next_power_of_2(n), **pdl_args(k))
