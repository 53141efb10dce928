"""FP8 GEMV for decode steps of one row per group: no tensor cores, no split-K.

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
multiplies them with the row's e4m3 values (float32 products, exact), accumulating
elementwise in registers and reducing along K once at the end; then both scales, one
rounding to x's dtype.  A group of several rows takes them one at a time, re-reading its
slab.  On the H100 one row a group ran 1.3-1.44x faster than the split-K kernel on each of
Scout's four FP8 shapes and a batch-1 step of 12 layers 0.94x; on the H200 full-size
Scout's batch-1 graph replay took 7.62 ms against 7.98 with the split-K kernel (the
rounds' spreads touching), the GEMV at 67% of the copy rate (BENCHMARKS.md, twenty-second
session; :data:`PARTIAL_ENABLED` is the next step).  The grid holds one slot per group
that can have rows (:func:`routed_slots`); slot j finds the j-th group with rows by a
prefix sum over ``offs`` (:func:`group_span`), so the 15 unrouted experts of a batch-1
step launch nothing.

The result is the split-K kernel's up to float32 summation order (the products are the
same exact float32 values; both round once to x's dtype).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from chunklocal._validate import env_count
from chunklocal.models.quant_triton import available, pdl_args, triton

if triton is not None:
    import triton.language as tl

    from chunklocal.models.quant_triton import pdl_start

#: The switch, read at import: ``fp8_grouped_mm_small`` takes :func:`fp8_gemv` for steps
#: whose groups have at most :data:`MAX_ROWS` rows.  On since the twenty-second session's
#: H100 A/B (``benchmarks/switch_ab.py --switches gemv``; ``CHUNKLOCAL_FP8_GEMV=0`` turns
#: it off; ``benchmarks/fp8_small_m.py --gemv-tune`` times its tiles).
GEMV_ENABLED = os.environ.get("CHUNKLOCAL_FP8_GEMV", "1") == "1"
#: Most rows of one group the GEMV takes: 1, a batch-1 decode step (its routed expert's
#: group and the shared expert's have one row each) and dense layers of one row.  Groups of
#: more rows re-read their slab per row (from L2 if it is still there);
#: ``CHUNKLOCAL_FP8_GEMV_MAX_ROWS`` raises the limit for an A/B.  A first form took up to
#: 4 rows a pass, one accumulator each, and lost to the split-K kernel on the H100 at 2
#: rows (1.12x a 12-layer step) and 4 (1.69x): each row's bytes loaded as a full tile
#: (BENCHMARKS.md, twenty-second session).
MAX_ROWS = env_count("CHUNKLOCAL_FP8_GEMV_MAX_ROWS", "1", "rows")
#: ``(block_n, block_k, num_warps)``: the accumulator holds ``block_n x block_k`` float32
#: values, 64 a thread.  Within 5% of the fastest of 12 tiles on each of Scout's four FP8
#: shapes at one row (H100, ``benchmarks/fp8_small_m.py --gemv-tune 1``).
DEFAULT_TILE = (16, 512, 4)
#: More weight bytes in flight per SM.  The H200's full-size batch-1 profile put the
#: one-row GEMV at 67% of the copy rate (4.24 ms for about 12.1 GB; twenty-second session)
#: where the H100 tune had it at 74-87% of the floor: a faster memory needs more bytes in
#: flight than the default form's four programs an SM of one 8 KB tile each (its float32
#: accumulator, one value per weight byte in flight, takes 120 registers a thread).
#: With ``PARTIAL`` each thread adds the products of one 16-byte load (16 e4m3 or 8
#: 16-bit weights) before accumulating (a reshape within the thread's registers, no
#: shuffles): 64 registers, eight programs an SM, 64 KB in flight (sm_90 compile; the
#: 16-bit form 67 registers, 112 KB).  Requesting the next K step's tile before this
#: step's products instead took 133 registers (three programs, 48 KB).  The conversions may
#: bind as much as the bytes: each weight byte takes an e4m3 -> f16 -> f32 conversion, and
#: at the default tile each thread converts the row's bytes again for each of its four
#: weight rows; tiles of one weight row a warp (``block_n == num_warps``) convert them once
#: (``fp8_small_m``'s tune list has them).  On by default since the H200 A/B (27th
#: session, full-size Scout FP8, batch 1: 0.958x the step's replay time alone and 0.926x
#: with PDL, faster in every round; 0.996-1.0x at batches 16 and 64; the engine's token
#: tests pass with both on; BENCHMARKS.md).  ``CHUNKLOCAL_GEMV_PARTIAL=0`` turns it off
#: (``switch_ab --switches gemv_partial``; ``fp8_small_m --gemv-tune``'s ``_part`` columns).
PARTIAL_ENABLED = os.environ.get("CHUNKLOCAL_GEMV_PARTIAL", "1") == "1"
#: The e4m3 form's tile with ``PARTIAL``: twice the default's K step.  On the H100 (24th
#: session, ``fp8_small_m --rows 1 --gemv-tune 1``, 24 tiles) it was the fastest or within
#: 2% of it on each of Scout's four FP8 shapes: 0.81x the default tile's time on the
#: experts' w2, 0.88-0.89x on the dense ones, 0.98x on w13 (BENCHMARKS.md).  The 16-bit
#: form keeps :data:`DEFAULT_TILE` (its 1024-wide step would hold twice the bytes).
PARTIAL_TILE = (16, 1024, 4)
#: The tensor-core form (``CHUNKLOCAL_GEMV_MMA=1``; ``switch_ab --switches gemv_mma``;
#: ``fp8_small_m --gemv-tune``'s ``_mma`` columns).  The elementwise forms' K loop, as the
#: JIT compiles it for sm_90, spends 3.2-3.4 instructions a weight byte, about 0.6 of them
#: e4m3 -> f16 pair conversions (``F2FP``, for the weights and again for the row's bytes)
#: and 1.2 f16 -> f32 ones (``HADD2.F32``), where the H200's copy rate asks about 16 bytes
#: a clock of each SM (BENCHMARKS.md, "Numbers behind code comments").  ``tl.dot`` of e4m3
#: tiles at a 16-row M is an f16 MMA after the same conversions (the split-K kernel's
#: case); at M >= 64 it is sm_90's e4m3 ``wgmma`` (``QGMMA``), which takes the bytes as
#: they are.  So the weights are the dot's M side, swapped with the rows (``out.T = w @
#: x.T``): ``BLOCK_N`` (64) output columns a program, the group's rows the N side padded
#: to :data:`MMA_ROWS` (masked loads: no bytes read), the K loop a cp.async pipeline:
#: 1.6 instructions a weight byte, none a conversion (tests/test_triton_sm90.py checks
#: the machine code).  Up to :data:`MMA_ROWS` rows of a group take one pass over its slab
#: (the elementwise forms re-read it per row).  Numerics: every :data:`MMA_IMPRECISE`
#: products of the tensor core's reduced-precision accumulator added to a float32 sum, in
#: another order than the elementwise forms'.  Written after the device time: off until a
#: GPU A/B.
MMA_ENABLED = os.environ.get("CHUNKLOCAL_GEMV_MMA", "0") == "1"
#: ``(block_n, block_k, num_warps, num_stages)`` of the tensor-core form: 64 weight rows
#: (wgmma's M), 16 KB of weights a stage, three stages (61 KB of shared memory with the
#: rows' tiles: three programs an SM, about 144 KB of weights in flight).
MMA_TILE = (64, 256, 4, 3)
MMA_ROWS = 16  # the rows' side of the dot (tl.dot's least N)
#: e4m3 products a ``wgmma`` sums before a float32 add: one instruction's K (32), the
#: bound tests/gpu/test_fp8_gpu.py's error model was set for (``ACC_U``); DeepSeek-V3
#: promotes every 128 (four instructions, fewer waits: the next knob to try).
MMA_IMPRECISE = 32


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
    def gemv_slab(w_ptr, offs_ptr, N, stride_we, stride_wn, num_rows, num_experts,
                  HAS_OFFS: tl.constexpr, BLOCK_N: tl.constexpr, EXPERTS_POW2: tl.constexpr):
        """This program's group (``expert``, its rows ``start:end``) and its ``BLOCK_N``
        columns of the group's weights: ``(expert, start, end, cols, col_ok, w_rows)``,
        ``w_rows`` the pointers of the columns' rows ``[BLOCK_N, 1]``."""
        expert, start, end = group_span(offs_ptr, tl.program_id(1), num_rows, num_experts,
                                        HAS_OFFS, True, EXPERTS_POW2)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = w_ptr + expert.to(tl.int64) * stride_we + cols[:, None].to(tl.int64) * stride_wn
        return expert, start, end, cols, cols < N, w_rows

    # num_rows (the batch) varies per call: no recompiles for it
    @triton.jit(do_not_specialize=["num_rows"])
    def _gemv_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, offs_ptr, out_ptr, N, K, stride_xm,
                     stride_we, stride_wn, stride_se, stride_om, num_rows, num_experts,
                     SCALED: tl.constexpr, HAS_OFFS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                     EXPERTS_POW2: tl.constexpr, PARTIAL: tl.constexpr,
                     GROUP: tl.constexpr, PDL: tl.constexpr):
        # SCALED: e4m3 rows and weights with their scales; else 16-bit ones (xs, ws unused)
        pdl_start(PDL)
        expert, start, end, cols, col_ok, w_rows = gemv_slab(
            w_ptr, offs_ptr, N, stride_we, stride_wn, num_rows, num_experts, HAS_OFFS, BLOCK_N,
            EXPERTS_POW2)
        ks = tl.arange(0, BLOCK_K)
        if SCALED:
            w_scale = tl.load(ws_ptr + expert * stride_se + cols, mask=col_ok, other=0.0)
        # The row's K offsets repeated down the tile's columns: its bytes are loaded as a
        # [BLOCK_N, BLOCK_K] tile (each column's K-slice again, L1 hits) so that they come
        # in the weights' layout.  Loaded as one [BLOCK_K] vector and broadcast, they took
        # a shared-memory exchange and two barriers every K step (the sm_90 PTX).
        k2d = (cols * 0)[:, None] + ks[None, :]
        for m in range(start, end):  # one row a pass; a second row re-reads the slab
            row_n = cols * 0 + m  # the row as a [BLOCK_N] block (the interpreter's masks)
            x_row = xq_ptr + tl.cast(m, tl.int64) * stride_xm
            if PARTIAL:
                acc = tl.zeros((BLOCK_N, BLOCK_K // GROUP), dtype=tl.float32)
            else:
                acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                if EVEN_N and EVEN_K:
                    wk = tl.load(w_rows + (k0 + ks)[None, :])
                else:
                    wk = tl.load(w_rows + (k0 + ks)[None, :],
                                 mask=col_ok[:, None] & ((k0 + k2d) < K), other=0.0)
                if EVEN_K:
                    xk = tl.load(x_row + k0 + k2d)
                else:
                    xk = tl.load(x_row + k0 + k2d, mask=(k0 + k2d) < K, other=0.0)
                prod = wk.to(tl.float32) * xk.to(tl.float32)
                if PARTIAL:  # each thread's GROUP contiguous K values (one 16-byte load) first
                    acc += tl.sum(tl.reshape(prod, (BLOCK_N, BLOCK_K // GROUP, GROUP)), axis=2)
                else:
                    acc += prod
            total = tl.sum(acc, axis=1)
            if SCALED:
                total = total * tl.load(xs_ptr + row_n) * w_scale
            out = out_ptr + tl.cast(m, tl.int64) * stride_om + cols
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=col_ok)


    @triton.jit(do_not_specialize=["num_rows"])
    def _gemv_mma_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, offs_ptr, out_ptr, N, K, stride_xm,
                         stride_we, stride_wn, stride_se, stride_om, num_rows, num_experts,
                         HAS_OFFS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_R: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr,
                         EXPERTS_POW2: tl.constexpr, IMPRECISE: tl.constexpr,
                         PDL: tl.constexpr):
        # out[rows, cols].T = w[expert, cols, :] @ xq[rows, :].T, scaled: the weights are the
        # dot's M side (wgmma's 64), the rows its N side (masked past the group's end)
        pdl_start(PDL)
        expert, start, end, cols, col_ok, w_rows = gemv_slab(
            w_ptr, offs_ptr, N, stride_we, stride_wn, num_rows, num_experts, HAS_OFFS, BLOCK_N,
            EXPERTS_POW2)
        ks = tl.arange(0, BLOCK_K)
        rs = tl.arange(0, BLOCK_R)
        w_scale = tl.load(ws_ptr + expert * stride_se + cols, mask=col_ok, other=0.0)
        for r0 in range(start, end, BLOCK_R):  # MMA_ROWS rows a pass over the slab
            rows = r0 + rs
            row_ok = rows < end
            x_cols = xq_ptr + rows[None, :].to(tl.int64) * stride_xm  # [1, BLOCK_R]
            acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + ks
                if EVEN_N and EVEN_K:
                    wk = tl.load(w_rows + kk[None, :])
                else:
                    wk = tl.load(w_rows + kk[None, :], mask=col_ok[:, None] & (kk < K)[None, :],
                                 other=0.0)
                xk = tl.load(x_cols + kk[:, None], mask=row_ok[None, :] & (kk < K)[:, None],
                             other=0.0)  # [BLOCK_K, BLOCK_R]: K-major, as wgmma's e4m3 B
                acc = tl.dot(wk, xk, acc, max_num_imprecise_acc=IMPRECISE)
            x_scale = tl.load(xs_ptr + rows, mask=row_ok, other=0.0)
            total = acc * w_scale[:, None] * x_scale[None, :]
            out = out_ptr + rows[None, :].to(tl.int64) * stride_om + cols[:, None]
            tl.store(out, total.to(out_ptr.dtype.element_ty),
                     mask=col_ok[:, None] & row_ok[None, :])


def takes(group_rows: int, forced: bool | None = None) -> bool:
    """Whether ``fp8_grouped_mm_small`` hands a step whose groups have at most
    ``group_rows`` rows to :func:`fp8_gemv`: ``forced`` if given, else
    :data:`GEMV_ENABLED` and ``group_rows <= MAX_ROWS``."""
    if forced is not None:
        return forced
    return GEMV_ENABLED and group_rows <= MAX_ROWS


def fp8_gemv(xq: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype, w: torch.Tensor,
             w_scale: torch.Tensor, offs: torch.Tensor | None, *, block_n: int | None = None,
             block_k: int | None = None, num_warps: int | None = None,
             partial: bool | None = None, mma: bool | None = None,
             num_stages: int | None = None) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of the quantized ``xq [M, K]`` (e4m3, per-row scales
    ``x_scale [M, 1]``) times ``w[e].T`` (``w [E, N, K]`` e4m3, ``w_scale [E, N]``) ->
    ``[M, N]`` in ``dtype``; ``offs`` None: one group of every row (``E == 1``).  Right
    for any rows per group, fast at one (a group's second row re-reads its slab).  Rows
    past ``offs[-1]`` are unspecified.  The tile defaults to :data:`DEFAULT_TILE`;
    ``partial`` None: :data:`PARTIAL_ENABLED`; ``mma`` None: :data:`MMA_ENABLED` (the
    tensor-core form at :data:`MMA_TILE`, whose ``num_stages`` is its own keyword)."""
    if triton is None:
        raise RuntimeError("fp8_gemv needs Triton")
    if xq.stride(1) != 1 or w.stride(2) != 1 or w_scale.stride(1) != 1:
        raise ValueError("fp8_gemv needs xq, w and w_scale contiguous along K / N")
    if offs is None and w.shape[0] != 1:
        raise ValueError(f"offs=None means one group, got {w.shape[0]} experts")
    out = torch.empty(xq.shape[0], w.shape[1], dtype=dtype, device=xq.device)
    if MMA_ENABLED if mma is None else mma:
        _launch_mma(xq, x_scale, w, w_scale, offs, out, block_n, block_k, num_warps,
                    num_stages)
    else:
        _launch(xq, x_scale, w, w_scale, offs, out, True, block_n, block_k, num_warps,
                partial)
    return out


def _launch_mma(xq, x_scale, w, w_scale, offs, out, block_n, block_k, num_warps, num_stages):
    """The tensor-core form's one launch, the tile's None entries from :data:`MMA_TILE`."""
    tile = [MMA_TILE[i] if v is None else v
            for i, v in enumerate((block_n, block_k, num_warps, num_stages))]
    _launch_slabs(_gemv_mma_kernel, xq, x_scale, w, w_scale, offs, out, tile[0], tile[1],
                  BLOCK_R=MMA_ROWS, IMPRECISE=MMA_IMPRECISE, num_warps=tile[2],
                  num_stages=tile[3])


def _launch_slabs(kernel, x, x_scale, w, w_scale, offs, out, block_n, block_k, **meta):
    """Launch either GEMV kernel over its grid (``block_n`` columns of one group's
    weights a program, :func:`routed_slots` groups) with the arguments both take; the
    kernel's own ones in ``meta``."""
    num_rows, k_dim = x.shape
    num_experts, n_dim, _ = w.shape
    slots = 1 if offs is None else routed_slots(num_rows, num_experts)
    kernel[(triton.cdiv(n_dim, block_n), slots)](
        x, x_scale, w, w_scale, x if offs is None else offs, out, n_dim, k_dim, x.stride(0),
        w.stride(0), w.stride(1), w_scale.stride(0), out.stride(0), num_rows, num_experts,
        HAS_OFFS=offs is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_N=n_dim % block_n == 0, EVEN_K=k_dim % block_k == 0,
        EXPERTS_POW2=triton.next_power_of_2(num_experts), **meta, **pdl_args(x))


def _launch(x, x_scale, w, w_scale, offs, out, scaled, block_n, block_k, num_warps, partial):
    """The kernel's one launch: ``partial`` None from :data:`PARTIAL_ENABLED`, the tile's
    None entries from :data:`PARTIAL_TILE` (partial sums of e4m3 weights) or
    :data:`DEFAULT_TILE`."""
    partial = PARTIAL_ENABLED if partial is None else partial
    tile = PARTIAL_TILE if partial and w.element_size() == 1 else DEFAULT_TILE
    block_n = tile[0] if block_n is None else block_n
    block_k = tile[1] if block_k is None else block_k
    num_warps = tile[2] if num_warps is None else num_warps
    _launch_slabs(_gemv_kernel, x, x_scale, w, w_scale, offs, out, block_n, block_k,
                  SCALED=scaled, PARTIAL=partial,
                  GROUP=16 // w.element_size(),  # a 16-byte load's weights
                  num_warps=num_warps)


#: Whether :func:`linear` runs a plain 16-bit ``nn.Linear`` of one row (a batch-1 decode
#: step's attention projections and LM head, where cuBLAS runs a split-K GEMM and its
#: reduce) through :func:`gemv16`.  Written after the twenty-second session's device time:
#: off until a GPU A/B measures it (``CHUNKLOCAL_GEMV_LINEAR=1``; ``benchmarks/switch_ab.py
#: --switches gemv16``).
LINEAR_ENABLED = os.environ.get("CHUNKLOCAL_GEMV_LINEAR", "0") == "1"


def gemv16(x: torch.Tensor, w: torch.Tensor, *, block_n: int | None = None,
           block_k: int | None = None, num_warps: int | None = None,
           partial: bool | None = None) -> torch.Tensor:
    """``x [M, K] @ w[N, K].T`` for 16-bit ``x`` and ``w`` of one dtype, float32 sums,
    one rounding: :func:`fp8_gemv`'s kernel without scales (M = 1 is its case), with its
    tile keywords."""
    if triton is None:
        raise RuntimeError("gemv16 needs Triton")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("gemv16 needs x and w contiguous along K")
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    _launch(x, x, w.unsqueeze(0), w.unsqueeze(0), None, out, False, block_n, block_k,
            num_warps, partial)
    return out


def linear(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, through :func:`gemv16` where :data:`LINEAR_ENABLED`, ``layer`` is a
    plain ``nn.Linear`` without bias whose weight has x's dtype, and ``x`` is one 16-bit
    row Triton runs on (the step's shape, the same at capture and replay)."""
    if (LINEAR_ENABLED and type(layer) is nn.Linear and layer.bias is None and x.dim() == 2
            and x.shape[0] == 1 and x.dtype == layer.weight.dtype and available(x)):
        return gemv16(x, layer.weight)
    return layer(x)
