"""Triton grouped GEMMs for steps with few rows per expert (decode): float and FP8 weights.

``grouped_mm_small(x, w, offs)`` computes what :func:`chunklocal.models.moe.expert_mm`
does for float weights: rows ``offs[e-1]:offs[e]`` of ``x [M, K]`` times ``w[e].T``
(``w [E, N, K]``).  The grid is static (``cdiv(N, BLOCK_N)`` x ``E``; capturable):
each program owns one ``BLOCK_N`` slab of one expert's weights, returns at once when
the expert has no rows (so unrouted experts are never read), and streams its slab
over K once per ``BLOCK_M`` rows.  With at most ``BLOCK_M`` rows per expert every
routed weight is read exactly once; with many rows per expert torch's grouped kernel
(``torch._grouped_mm``) is the better choice, so the MoE layer uses this one only up
to ``MoE.triton_max_pairs`` (token, expert) pairs (0, i.e. off, until measured).

``fp8_grouped_mm_small(x, w, w_scale, offs, scale_ub)`` is the same kernel for FP8
weights (``w [E, N, K]`` float8_e4m3fn, per-output-channel ``w_scale [E, N]``) with the
per-token activation quantization of :func:`chunklocal.models.quant.quantize_per_token`
fused in: each program finds its rows' amax over K (the rows are a few KiB and stay in
L2, so every N-tile rereading them costs no HBM traffic), scales with IEEE division
(``div_rn``, the CPU's bits: a scale 1 ulp off moves activations to the neighbouring e4m3
value), rounds to e4m3 and multiplies on the FP8 tensor cores.  No separate amax and
quantize kernels run, and each routed weight is read once.  A dense FP8 layer is the case
``E == 1`` (:func:`fp8_linear_small`).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton; the flag stays off there
    triton = None


def available(x: torch.Tensor) -> bool:
    """Triton can run the kernel on ``x``: CUDA bf16/fp16 (fp32 inputs would go through
    TF32 in ``tl.dot``), or any device under ``TRITON_INTERPRET=1`` (tests)."""
    if triton is None:
        return False
    return _interpreting() or (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16))


#: The FP8 kernel's switch, read at import: ``CHUNKLOCAL_FP8_TRITON=1`` turns it on.  Off
#: (the default until it has run and been measured on a GPU: docs/gpu-runbook.md), FP8
#: layers of every size go through torch's ``_scaled_mm`` / ``_scaled_grouped_mm``.
FP8_ENABLED = __import__("os").environ.get("CHUNKLOCAL_FP8_TRITON", "0") == "1"

#: Rows per pass over a weight slab.  16 keeps Triton on Hopper's mma.sync path, whose FP8
#: partial sums are float32; a 64-row tile takes the wgmma path, whose FP8 partial sums are
#: coarser and never promoted (Triton's sm90 default): on the H200 that went 4-15% past the
#: 2**-12 accumulation bound at K = 8192 (tests/gpu/test_fp8_triton_gpu.py), and asking for
#: promotion (``max_num_imprecise_acc``) failed to compile on Triton 3.x (32 and 128 alike).
FP8_BLOCK_M = 16


def fp8_available(x: torch.Tensor) -> bool:
    """:func:`fp8_grouped_mm_small` runs on ``x`` and is switched on."""
    return FP8_ENABLED and available(x)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, offs_ptr, N, K,
                             stride_xm, stride_we, stride_wn, stride_om,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        expert = tl.program_id(1)
        end = tl.load(offs_ptr + expert)
        start = tl.load(offs_ptr + expert - 1, mask=expert > 0, other=0)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < end
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + ks
                xk = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :],
                             mask=row_ok[:, None] & (k[None, :] < K), other=0.0)
                wk = tl.load(w_base + k[:, None], mask=(cols[None, :] < N) & (k[:, None] < K),
                             other=0.0)
                acc += tl.dot(xk, wk)
            out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & (cols[None, :] < N))


if triton is not None:
    # num_rows (the batch) and scale_ub vary per call: no recompiles for them (a 1 or a
    # multiple of 16 would otherwise each get a kernel of its own, at graph capture too)
    @triton.jit(do_not_specialize=["num_rows", "scale_ub"])
    def _fp8_grouped_gemm_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, offs_ptr, N, K, scale_ub,
                                 stride_xm, stride_we, stride_wn, stride_se, stride_om,
                                 num_rows, HAS_OFFS: tl.constexpr, HAS_UB: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        expert = tl.program_id(1)
        if HAS_OFFS:
            end = tl.load(offs_ptr + expert)
            start = tl.load(offs_ptr + expert - 1, mask=expert > 0, other=0)
        else:  # one group of every row (a dense layer): no offsets tensor to make
            end = num_rows
            start = 0
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn
        w_scale = tl.load(ws_ptr + expert * stride_se + cols, mask=col_ok, other=0.0)
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < end
            x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
            amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + ks
                xk = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & (k[None, :] < K),
                             other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(xk), axis=1))
            if HAS_UB:
                amax = tl.minimum(amax, scale_ub)
            scale = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.full((BLOCK_M,), 448.0,
                                                                      tl.float32))
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + ks
                xk = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & (k[None, :] < K),
                             other=0.0).to(tl.float32)
                xq = tl.math.div_rn(xk, tl.broadcast_to(scale[:, None], (BLOCK_M, BLOCK_K)))
                xq = tl.minimum(tl.maximum(xq, -448.0), 448.0).to(tl.float8e4nv)
                wk = tl.load(w_base + k[:, None], mask=col_ok[None, :] & (k[:, None] < K),
                             other=0.0)
                acc = tl.dot(xq, wk, acc)
            acc = acc * scale[:, None] * w_scale[None, :]
            out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fp8_grouped_mm_small(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         offs: torch.Tensor | None, scale_ub: float | None = None, *,
                         block_m: int | None = None, block_n: int | None = None,
                         block_k: int = 256, num_warps: int = 4) -> torch.Tensor:
    """What :func:`chunklocal.models.quant.fp8_grouped_mm` computes (per-token dynamic
    activation scales, capped at ``scale_ub``), in one kernel: ``x [M, K]`` bf16 rows sorted
    by expert, ``w [E, N, K]`` float8_e4m3fn, ``w_scale [E, N]`` float32, ``offs`` int32 [E]
    group ends (``None``: one group of all M rows, ``E == 1``).  Rows past ``offs[-1]`` are
    left unwritten.

    Tiles: ``block_m`` rows per pass over an N-slab (``FP8_BLOCK_M``); ``block_n`` 32 for
    N <= 8192 so that Scout's down projections (N = 5120) still give 160 programs for 132
    SMs, else 64."""
    if triton is None:
        raise RuntimeError("fp8_grouped_mm_small needs Triton")
    num_rows, k_dim = x.shape
    num_experts, n_dim, _ = w.shape
    if x.stride(1) != 1 or w.stride(2) != 1 or w_scale.stride(1) != 1:
        raise ValueError("fp8_grouped_mm_small needs x, w and w_scale contiguous along K / N")
    if offs is None and num_experts != 1:
        raise ValueError(f"offs=None means one group, got {num_experts} experts")
    if block_m is None:
        block_m = FP8_BLOCK_M
    if block_n is None:
        block_n = 32 if n_dim <= 8192 else 64
    out = torch.empty(num_rows, n_dim, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n_dim, block_n), num_experts)
    _fp8_grouped_gemm_kernel[grid](
        x, w, w_scale, out, x if offs is None else offs, n_dim, k_dim,
        0.0 if scale_ub is None else float(scale_ub), x.stride(0), w.stride(0), w.stride(1),
        w_scale.stride(0), out.stride(0), num_rows, HAS_OFFS=offs is not None,
        HAS_UB=scale_ub is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=3 if block_m > 16 else 4)
    return out


def fp8_linear_small(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     scale_ub: float | None = None) -> torch.Tensor:
    """``quant.fp8_linear`` without bias, for few rows: ``x [M, K]`` @ ``w [N, K]`` (FP8,
    scales ``w_scale [N]``) through the grouped kernel with one group."""
    return fp8_grouped_mm_small(x, w.unsqueeze(0), w_scale.view(1, -1), None, scale_ub)


def grouped_mm_small(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *,
                     block_m: int = 16, block_n: int = 64, block_k: int = 128,
                     num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """``x [M, K]`` (row-major), ``w [E, N, K]`` (K contiguous), ``offs`` int32 [E] group
    ends with ``offs[-1] == M``; returns ``[M, N]`` in ``x.dtype``, float32 accumulation."""
    if triton is None:
        raise RuntimeError("grouped_mm_small needs Triton")
    num_rows, k_dim = x.shape
    num_experts, n_dim, _ = w.shape
    if x.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError("grouped_mm_small needs x and w contiguous along K")
    out = torch.empty(num_rows, n_dim, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n_dim, block_n), num_experts)
    _grouped_gemm_kernel[grid](x, w, out, offs, n_dim, k_dim, x.stride(0), w.stride(0),
                               w.stride(1), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                               BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages)
    return out
