"""A Triton grouped GEMM for steps with few rows per expert (decode), behind a flag.

``grouped_mm_small(x, w, offs)`` computes what :func:`chunklocal.models.moe.expert_mm`
does for float weights: rows ``offs[e-1]:offs[e]`` of ``x [M, K]`` times ``w[e].T``
(``w [E, N, K]``).  The grid is static (``cdiv(N, BLOCK_N)`` x ``E``; capturable):
each program owns one ``BLOCK_N`` slab of one expert's weights, returns at once when
the expert has no rows (so unrouted experts are never read), and streams its slab
over K once per ``BLOCK_M`` rows.  With at most ``BLOCK_M`` rows per expert every
routed weight is read exactly once; with many rows per expert torch's grouped kernel
(``torch._grouped_mm``) is the better choice, so the MoE layer uses this one only up
to ``MoE.triton_max_pairs`` (token, expert) pairs (0, i.e. off, until measured).
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
