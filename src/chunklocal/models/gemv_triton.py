"""FP8 GEMV for decode steps: a few rows per group, no tensor cores, no split-K.

``moe_triton.fp8_grouped_mm_small``'s split-K kernel pads every group's rows to a 16-row
``tl.dot`` tile and, where the N-tiles alone cannot fill the SMs, cuts K into slices whose
float32 partials a second launch adds and a third casts.  At a batch-1 step of Scout FP8
each group (the routed expert, the shared expert as group E) has one row: the w13 GEMM
runs one slice (512 programs of a 64 x 5120 slab), the w2 GEMM two slices plus the sum and
the cast (160 tiles x 2 slices: 1.2 waves of two programs per SM, the second 21% full).
On the H200 the expert GEMMs of that step ran at 66% of the copy rate (BENCHMARKS.md,
twentieth session).

:func:`fp8_gemv` instead gives each program a narrow slab (``BLOCK_N`` output columns,
the whole of K) of one group's weights: enough programs at any batch to fill every SM
(w2: 5120 / 16 = 320 per group) without splitting K, so no partials, no sum, no cast.
Each program streams its slab in ``BLOCK_K`` steps, converts the e4m3 bytes to float32 and
multiplies them with up to ``ROWS`` (1, 2 or 4) of the group's rows at a time (the rows'
e4m3 values, float32 products exact), accumulating elementwise in registers, one
accumulator a row, and reducing along K once at the end; then both scales, one rounding to
x's dtype.  A group with more than ``ROWS``
rows takes its rows ``ROWS`` at a time, re-reading its slab (from L2: one program's slab
is 80-128 KB).  The grid holds one slot per group that can have rows
(:func:`routed_slots`); slot j finds the j-th group with rows by a prefix sum over
``offs`` (:func:`group_span`), so the 15 unrouted experts of a batch-1 step launch nothing.

The result is the split-K kernel's up to float32 summation order (the products are the
same exact float32 values; both round once to x's dtype).
"""

from __future__ import annotations

import os

import torch

from chunklocal.models.quant_triton import triton

if triton is not None:
    import triton.language as tl

#: The switch, read at import: ``fp8_grouped_mm_small`` takes :func:`fp8_gemv` for steps
#: whose groups have at most :data:`MAX_ROWS` rows (``CHUNKLOCAL_FP8_GEMV=1``).  Written
#: after the twenty-first session's device time: off until a GPU A/B measures it
#: (``benchmarks/fp8_small_m.py --gemv-tune``, ``benchmarks/switch_ab.py --switches gemv``).
GEMV_ENABLED = os.environ.get("CHUNKLOCAL_FP8_GEMV", "0") == "1"
#: Most rows of one group the GEMV takes (a batch of 4 tokens: the shared group has 4).
MAX_ROWS = 4
#: ``rows per pass -> (block_n, block_k, num_warps)``: each row's elementwise accumulator
#: holds ``block_n x block_k`` float32 values: 64 a thread at one row, 32 at two, 16 at four.
DEFAULT_TILES = {1: (16, 512, 4), 2: (16, 256, 4), 4: (8, 256, 4)}


def routed_slots(num_rows: int, num_experts: int) -> int:
    """A grouped kernel's expert dimension when it launches only groups that can have
    rows: M rows reach at most ``min(E, M)`` groups, so a program of slot j serves the
    j-th group with rows (:func:`group_span`) and no program is launched for the groups a
    small step leaves empty.  One slot per group launched ``E - 1`` slabs of empty
    programs at a batch-1 step, each wave holding SM resources while it read ``offs`` and
    returned: the routed w13 GEMM ran at 52% of the copy rate where the dense gate/up of
    half its bytes ran at 62% (BENCHMARKS.md, fourteenth session).  At least one slot: a
    step of no rows still launches a grid."""
    return max(1, min(num_experts, num_rows))


if triton is not None:
    @triton.jit
    def group_span(offs_ptr, slot, num_rows, num_experts, HAS_OFFS: tl.constexpr,
                   ROUTED_SLOTS: tl.constexpr, EXPERTS_POW2: tl.constexpr):
        """(group, first row, end row) of a grouped kernel's ``slot``: the slot-th group
        with rows (ROUTED_SLOTS), group ``slot`` (offsets, one slot per group), or every
        row (no offsets: a dense layer)."""
        if HAS_OFFS and ROUTED_SLOTS:
            es = tl.arange(0, EXPERTS_POW2)
            e_ok = es < num_experts
            ends = tl.load(offs_ptr + es, mask=e_ok, other=0)
            starts = tl.load(offs_ptr + es - 1, mask=e_ok & (es > 0), other=0)
            routed = e_ok & (ends > starts)
            hit = routed & (tl.cumsum(routed.to(tl.int32), 0) == slot + 1)
            # no hit (fewer routed groups than slots): start == end == 0, nothing is read
            expert = tl.sum(tl.where(hit, es, 0), 0)
            end = tl.sum(tl.where(hit, ends, 0), 0)
            start = tl.sum(tl.where(hit, starts, 0), 0)
        elif HAS_OFFS:
            expert = slot
            end = tl.load(offs_ptr + expert)
            start = tl.load(offs_ptr + expert - 1, mask=expert > 0, other=0)
        else:  # tensors, as the other forms' (the interpreter's loop bounds and masks)
            expert = slot
            start = slot * 0
            end = start + num_rows
        return expert, start, end

    @triton.jit
    def _row_product(acc, wk, x_row, k2d, ok, k_ok, EVEN_K: tl.constexpr):
        """``acc + wk * x`` for one row, its bytes loaded as ``[BLOCK_N, BLOCK_K]`` (each
        column's K-slice again: L1 hits) so that they arrive in the weights' layout, with
        no shared-memory exchange between the loads and the products."""
        if EVEN_K:
            xk = tl.load(x_row + k2d, mask=ok[:, None], other=0.0)
        else:
            xk = tl.load(x_row + k2d, mask=ok[:, None] & k_ok, other=0.0)
        return acc + wk * xk.to(tl.float32)

    @triton.jit
    def _row_store(acc, x_scale_ptr, out_row, w_scale, cols, col_ok, ok):
        """One row's sums along K, both scales, one rounding to the output's dtype."""
        total = tl.sum(acc, axis=1) * tl.load(x_scale_ptr + ok * 0, mask=ok, other=0.0) \
            * w_scale
        tl.store(out_row + cols, total.to(out_row.dtype.element_ty), mask=col_ok & ok)

    # num_rows (the batch) varies per call: no recompiles for it
    @triton.jit(do_not_specialize=["num_rows"])
    def _fp8_gemv_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, offs_ptr, out_ptr, N, K,
                         stride_xm, stride_we, stride_wn, stride_se, stride_om, num_rows,
                         num_experts, HAS_OFFS: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                         EXPERTS_POW2: tl.constexpr):
        pid_n = tl.program_id(0)
        expert, start, end = group_span(offs_ptr, tl.program_id(1), num_rows, num_experts,
                                        HAS_OFFS, True, EXPERTS_POW2)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn
        w_scale = tl.load(ws_ptr + expert * stride_se + cols, mask=col_ok, other=0.0)
        zero_n = (cols * 0)[:, None]  # the rows' K offsets repeated down the tile's columns
        for m0 in range(start, end, ROWS):
            # up to four rows a pass, one accumulator each (only ROWS of them exist); row
            # r's mask as a [BLOCK_N] block (constant down it)
            row_n = cols * 0 + m0
            x0 = xq_ptr + tl.cast(m0, tl.int64) * stride_xm
            acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            if ROWS > 1:
                acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            if ROWS > 2:
                acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
                acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + ks
                k2d = zero_n + k[None, :]
                k_ok = k2d < K
                if EVEN_N and EVEN_K:
                    wk = tl.load(w_rows + k[None, :])
                else:
                    wk = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok, other=0.0)
                wk = wk.to(tl.float32)
                acc0 = _row_product(acc0, wk, x0, k2d, row_n < end, k_ok, EVEN_K)
                if ROWS > 1:
                    acc1 = _row_product(acc1, wk, x0 + stride_xm, k2d, row_n + 1 < end, k_ok,
                                        EVEN_K)
                if ROWS > 2:
                    acc2 = _row_product(acc2, wk, x0 + 2 * stride_xm, k2d, row_n + 2 < end,
                                        k_ok, EVEN_K)
                    acc3 = _row_product(acc3, wk, x0 + 3 * stride_xm, k2d, row_n + 3 < end,
                                        k_ok, EVEN_K)
            out0 = out_ptr + tl.cast(m0, tl.int64) * stride_om
            _row_store(acc0, xs_ptr + m0, out0, w_scale, cols, col_ok, row_n < end)
            if ROWS > 1:
                _row_store(acc1, xs_ptr + m0 + 1, out0 + stride_om, w_scale, cols, col_ok,
                           row_n + 1 < end)
            if ROWS > 2:
                _row_store(acc2, xs_ptr + m0 + 2, out0 + 2 * stride_om, w_scale, cols,
                           col_ok, row_n + 2 < end)
                _row_store(acc3, xs_ptr + m0 + 3, out0 + 3 * stride_om, w_scale, cols,
                           col_ok, row_n + 3 < end)


def rows_per_pass(group_rows: int) -> int:
    """The kernel's ``ROWS``: a power of two covering ``group_rows``, at most MAX_ROWS."""
    return min(MAX_ROWS, triton.next_power_of_2(max(1, group_rows)))


def takes(group_rows: int, enabled: bool | None = None) -> bool:
    """Whether ``fp8_grouped_mm_small`` hands a step whose groups have at most
    ``group_rows`` rows to :func:`fp8_gemv` (``enabled`` None: :data:`GEMV_ENABLED`)."""
    return (GEMV_ENABLED if enabled is None else enabled) and group_rows <= MAX_ROWS


def fp8_gemv(xq: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype, w: torch.Tensor,
             w_scale: torch.Tensor, offs: torch.Tensor | None, group_rows: int, *,
             block_n: int | None = None, block_k: int | None = None,
             num_warps: int | None = None) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of the quantized ``xq [M, K]`` (e4m3, per-row scales
    ``x_scale [M, 1]``) times ``w[e].T`` (``w [E, N, K]`` e4m3, ``w_scale [E, N]``) ->
    ``[M, N]`` in ``dtype``; ``offs`` None: one group of every row (``E == 1``).  Every
    group has at most ``group_rows`` rows (a bound for the tile; more are still right,
    only slower).  Rows past ``offs[-1]`` are unspecified.  The tile defaults to
    :data:`DEFAULT_TILES`' for the rows per pass."""
    if triton is None:
        raise RuntimeError("fp8_gemv needs Triton")
    num_rows, k_dim = xq.shape
    num_experts, n_dim, _ = w.shape
    if xq.stride(1) != 1 or w.stride(2) != 1 or w_scale.stride(1) != 1:
        raise ValueError("fp8_gemv needs xq, w and w_scale contiguous along K / N")
    if offs is None and num_experts != 1:
        raise ValueError(f"offs=None means one group, got {num_experts} experts")
    rows = rows_per_pass(group_rows)
    tile = DEFAULT_TILES[rows]
    block_n = tile[0] if block_n is None else block_n
    block_k = tile[1] if block_k is None else block_k
    num_warps = tile[2] if num_warps is None else num_warps
    out = torch.empty(num_rows, n_dim, dtype=dtype, device=xq.device)
    slots = 1 if offs is None else routed_slots(num_rows, num_experts)
    grid = (triton.cdiv(n_dim, block_n), slots)
    _fp8_gemv_kernel[grid](
        xq, x_scale, w, w_scale, xq if offs is None else offs, out, n_dim, k_dim,
        xq.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), out.stride(0), num_rows,
        num_experts, HAS_OFFS=offs is not None, ROWS=rows, BLOCK_N=block_n,
        BLOCK_K=block_k, EVEN_N=n_dim % block_n == 0, EVEN_K=k_dim % block_k == 0,
        EXPERTS_POW2=triton.next_power_of_2(num_experts), num_warps=num_warps)
    return out
