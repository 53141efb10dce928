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

``fp8_grouped_mm_small(x, w, w_scale, offs, scale_ub)`` is its FP8 counterpart (``w [E,
N, K]`` float8_e4m3fn, per-output-channel ``w_scale [E, N]``), split along K so that a step
of one row still gives every SM several slabs to stream: the rows are quantized once per
token (models/quant_triton.py, the bits of :func:`chunklocal.models.quant.quantize_per_token`),
each (N-tile, K-slice, expert) program writes its scaled float32 partial product, and one
sum adds the slices (deterministic: no atomics).  A dense FP8 layer is the case ``E == 1``
(:func:`fp8_linear_small`).  Its first form quantized inside every program (the rows' amax
and division redone by each of hundreds of N-tiles) with one program per slab; on the H200
that ran at 5-39% of the copy rate, 2-5x slower than torch's path (BENCHMARKS.md).
"""

from __future__ import annotations

import os

import torch

import chunklocal.models.gemv_triton as gemv_triton
from chunklocal._validate import cdiv
from chunklocal.models.gemv_triton import routed_slots
from chunklocal.models.quant_triton import QuantRows, available, pdl_args, quantize_rows, triton

if triton is not None:
    import triton.language as tl

    from chunklocal.models.gemv_triton import group_span
    from chunklocal.models.quant_triton import pdl_start

#: The FP8 kernel's switch, read at import; ``CHUNKLOCAL_FP8_TRITON=0`` turns it off (FP8
#: layers of every size then go through torch's ``_scaled_mm`` / ``_scaled_grouped_mm``).
#: On since the H200 run of 2026-12-02 (BENCHMARKS.md): routed experts at 16-256 rows at
#: 89-102% of the copy rate against torch's 54-61%, dense layers of 1-16 rows at 45-55%
#: against 20-24%; full-size Scout FP8 decode at batch 64 49.3 ms against 61.1 ms.
FP8_ENABLED = os.environ.get("CHUNKLOCAL_FP8_TRITON", "1") == "1"

#: Rows per pass over a weight slab.  16 keeps Triton on Hopper's mma.sync path, whose FP8
#: partial sums are float32; a 64-row tile takes the wgmma path, whose FP8 partial sums are
#: coarser and never promoted (Triton's sm90 default): on the H200 that went 4-15% past the
#: 2**-12 accumulation bound at K = 8192 (tests/gpu/test_fp8_triton_gpu.py), and asking for
#: promotion (``max_num_imprecise_acc``) failed to compile on Triton 3.x (32 and 128 alike).
FP8_BLOCK_M = 16


def fp8_available(x: torch.Tensor | QuantRows) -> bool:
    """:func:`fp8_grouped_mm_small` runs on ``x`` and is switched on (rows that come
    quantized were made by quant_triton's kernel, so Triton runs where they are)."""
    if isinstance(x, QuantRows):
        return FP8_ENABLED and triton is not None
    return FP8_ENABLED and available(x)


if triton is not None:
    @triton.jit
    def _grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, offs_ptr, N, K,
                             stride_xm, stride_we, stride_wn, stride_om,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
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
    # num_rows (the batch) varies per call: no recompiles for it (a 1 or a multiple of 16
    # would otherwise each get a kernel of its own, at graph capture too)
    @triton.jit(do_not_specialize=["num_rows"])
    def _fp8_splitk_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, part_ptr, offs_ptr, out_ptr,
                           count_ptr, N, K, k_split, stride_xm, stride_we, stride_wn,
                           stride_se, stride_ps, stride_pm, stride_om, num_rows, num_experts,
                           HAS_OFFS: tl.constexpr, ROUTED_SLOTS: tl.constexpr,
                           REDUCE: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           EXPERTS_POW2: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        slot = tl.program_id(2)  # ROUTED_SLOTS: the slot-th expert with rows, else expert slot
        expert, start, end = group_span(offs_ptr, slot, num_rows, num_experts, HAS_OFFS,
                                        ROUTED_SLOTS, EXPERTS_POW2)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        k_lo = split * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
        w_base = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn
        w_scale = tl.load(ws_ptr + expert * stride_se + cols, mask=col_ok, other=0.0)
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_ok = rows < end
            x_rows = xq_ptr + rows[:, None].to(tl.int64) * stride_xm
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                k = k0 + ks
                xk = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & (k[None, :] < k_hi),
                             other=0.0)
                wk = tl.load(w_base + k[:, None], mask=col_ok[None, :] & (k[:, None] < k_hi),
                             other=0.0)
                acc = tl.dot(xk, wk, acc)
            x_scale = tl.load(xs_ptr + rows, mask=row_ok, other=0.0)
            acc = acc * x_scale[:, None] * w_scale[None, :]
            out = part_ptr + split * stride_ps + rows[:, None].to(tl.int64) * stride_pm \
                + cols[None, :]
            # float32 partials, or with one slice the output itself (x's dtype)
            tl.store(out, acc.to(part_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])
        # the last of this tile's K-slices to finish adds them, in slice order; a tile
        # with no rows (an expert or slot no row reached) has nothing to add and takes no
        # ticket -- every program of the tile agrees, so its counter stays zero
        if REDUCE:
            if end > start:
                tl.debug_barrier()  # every thread's partial stored before the ticket (release)
                counter = count_ptr + slot * tl.num_programs(0) + pid_n
                ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if ticket == tl.num_programs(1) - 1:
                    for m0 in range(start, end, BLOCK_M):
                        rows = m0 + tl.arange(0, BLOCK_M)
                        ok = (rows < end)[:, None] & col_ok[None, :]
                        src = part_ptr + rows[:, None].to(tl.int64) * stride_pm + cols[None, :]
                        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                        for s in range(0, tl.num_programs(1)):  # L2 (.cg): other SMs' stores
                            total += tl.load(src + s * stride_ps, mask=ok, other=0.0,
                                             cache_modifier=".cg")
                        dst = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
                        tl.store(dst, total.to(out_ptr.dtype.element_ty), mask=ok)
                    tl.store(counter, 0)  # ready for the next call on this stream


#: Programs per SM that split-K aims for: each streams its own slab, so a step of one row
#: keeps every SM loading (a program alone per SM was the old kernel's 0.3-0.9 TB/s).  2:
#: the H200 sweep of 2026-12-02 (BENCHMARKS.md) put it within 2% of the best measured split
#: on average over Scout's four shapes at 1, 16 and 64 rows (4 overshot: 11% short).
PROGRAMS_PER_SM = 2


_SM_COUNTS: dict[torch.device, int] = {}


def device_sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs per split are enough
    if device not in _SM_COUNTS:
        _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNTS[device]


def split_k_for(num_rows: int, num_experts: int, n_dim: int, k_dim: int, block_n: int,
                block_k: int, sm_count: int) -> int:
    """How many slices of K each (expert, N-tile) is cut into: enough programs for about
    ``PROGRAMS_PER_SM`` per SM, counting only the experts that can have rows (no more than
    ``num_rows``), and no slice thinner than ``block_k``."""
    tiles = cdiv(n_dim, block_n) * max(1, min(num_experts, num_rows))
    return max(1, min(cdiv(PROGRAMS_PER_SM * sm_count, tiles), cdiv(k_dim, block_k)))


#: Whether the FP8 kernel's grid has :func:`routed_slots` expert slots (on) or one per
#: expert.  Written after the fourteenth session's device time: off until an H200 run
#: measures it (``CHUNKLOCAL_FP8_ROUTED_SLOTS=1``; tests/gpu/test_fp8_triton_gpu.py).
ROUTED_SLOTS_ENABLED = os.environ.get("CHUNKLOCAL_FP8_ROUTED_SLOTS", "0") == "1"


#: Whether :func:`fp8_grouped_mm_small`'s kernel adds its K-slices itself: the last program
#: of each (expert, N-tile) to finish -- a ticket on a per-tile counter, after a barrier and
#: an acquire-release atomic -- sums the slices' float32 partials in slice order (so the
#: result is deterministic) and stores the output in x's dtype.  It saves the two launches
#: after every call (the sum over slices and the cast), 384 of a batch-1 Scout FP8 step's,
#: about 0.6-0.8 ms of its 12.3 (BENCHMARKS.md, twelfth session).  The counters are one
#: persistent zeroed buffer per device that each call leaves zeroed: calls on one stream at
#: a time.  Off until an H200 run measures it (``CHUNKLOCAL_FP8_SPLITK_REDUCE=1``).
SPLITK_REDUCE_IN_KERNEL = os.environ.get("CHUNKLOCAL_FP8_SPLITK_REDUCE", "0") == "1"
MAX_TILE_COUNTERS = 1 << 16  # (expert, N-tile) pairs of one call: Scout's largest is 17 x 256
_TILE_COUNTERS: dict[torch.device, torch.Tensor] = {}


def tile_counters(device: torch.device, needed: int) -> torch.Tensor:
    """The device's zeroed int32 ticket counters (made once, at the first call)."""
    if needed > MAX_TILE_COUNTERS:
        raise ValueError(f"fp8_grouped_mm_small: {needed} (expert, N-tile) pairs, more than "
                         f"MAX_TILE_COUNTERS={MAX_TILE_COUNTERS}")
    counters = _TILE_COUNTERS.get(device)
    if counters is None:
        counters = _TILE_COUNTERS[device] = torch.zeros(MAX_TILE_COUNTERS, dtype=torch.int32,
                                                        device=device)
    return counters


#: The split-K kernel's tile and pipeline, ``(block_n, block_k, num_warps, num_stages)``:
#: the default, and per (grouped, N, K) shape the fastest of the 44 choices that
#: ``benchmarks/fp8_small_m.py --tune 1`` timed at one row on an H100 (sixteenth session,
#: BENCHMARKS.md: 10-16% under the default on each of Scout's four shapes, a different
#: choice on each; repeats a few seconds apart differed by up to 30% on that machine).  Used
#: with :data:`TUNED_TILES_ENABLED` only, off until an engine A/B on the H200 measures it
#: (``CHUNKLOCAL_FP8_TUNED_TILES=1``; ``benchmarks/switch_ab.py --switches tiles``).
DEFAULT_TILE = (64, 256, 4, 4)
TUNED_TILES = {
    (False, 8192, 5120): (64, 128, 4, 4),   # Scout's dense gate/up (one group)
    (False, 5120, 8192): (128, 128, 4, 3),  # Scout's dense down
    (True, 16384, 5120): (32, 256, 4, 3),   # Scout's experts, w13
    (True, 5120, 8192): (64, 256, 4, 3),    # Scout's experts, w2
}
TUNED_TILES_ENABLED = os.environ.get("CHUNKLOCAL_FP8_TUNED_TILES", "0") == "1"


def tile_for(grouped: bool, n_dim: int, k_dim: int,
             tuned: bool | None = None) -> tuple[int, int, int, int]:
    """The tile ``fp8_grouped_mm_small`` launches for a shape when its caller names none:
    :data:`TUNED_TILES`' entry (:data:`DEFAULT_TILE` for a shape it does not name) when
    ``tuned`` (None: :data:`TUNED_TILES_ENABLED`), else :data:`DEFAULT_TILE`."""
    if TUNED_TILES_ENABLED if tuned is None else tuned:
        return TUNED_TILES.get((grouped, n_dim, k_dim), DEFAULT_TILE)
    return DEFAULT_TILE


def fp8_grouped_mm_small(x: torch.Tensor | QuantRows, w: torch.Tensor, w_scale: torch.Tensor,
                         offs: torch.Tensor | None, scale_ub: float | None = None, *,
                         block_n: int | None = None, block_k: int | None = None,
                         split_k: int | None = None, num_warps: int | None = None,
                         num_stages: int | None = None,
                         reduce_in_kernel: bool | None = None,
                         routed_slots_in_kernel: bool | None = None,
                         group_rows: int | None = None, gemv: bool | None = None
                         ) -> torch.Tensor:
    """What :func:`chunklocal.models.quant.fp8_grouped_mm` computes (per-token dynamic
    activation scales, capped at ``scale_ub``): ``x [M, K]`` bf16 rows sorted by expert,
    ``w [E, N, K]`` float8_e4m3fn, ``w_scale [E, N]`` float32, ``offs`` int32 [E] group ends
    (``None``: one group of all M rows, ``E == 1``).  Rows past ``offs[-1]`` are
    unspecified.

    Two steps: the rows are quantized once (:func:`quant_triton.quantize_rows`, torch's
    bits), then a split-K grouped GEMM (grid ``N-tiles x K-slices x E``, or x
    :func:`routed_slots` with :data:`ROUTED_SLOTS_ENABLED` / ``routed_slots_in_kernel``; an
    expert with no rows reads no weights) writes float32 partial products, scaled, that
    one sum over the slices adds up (or the kernel's last program of each tile,
    :data:`SPLITK_REDUCE_IN_KERNEL`; ``reduce_in_kernel`` overrides it); a single slice
    without the in-kernel sum stores the output itself, in x's dtype.  Tiles of
    ``FP8_BLOCK_M`` rows (mma.sync: float32 partial sums); ``split_k`` None:
    :func:`split_k_for`; ``block_n``, ``block_k``, ``num_warps`` and ``num_stages``: the
    tile and its pipeline, each None taken from :func:`tile_for` (benchmarks/fp8_small_m.py
    ``--tune`` times the choices).  ``x``
    may come quantized (:class:`quant_triton.QuantRows`: the first
    step done already, ``scale_ub`` with it).

    ``group_rows`` bounds the rows of any one group (None: M; the MoE layer passes its
    tokens, a group having at most one row per token): where it is at most
    ``gemv_triton.MAX_ROWS`` (1) and :data:`gemv_triton.GEMV_ENABLED` (on), the GEMM runs
    as :func:`gemv_triton.fp8_gemv` instead; ``gemv`` True or False forces the choice, and
    a call naming any of the split-K keywords above means the split-K kernel."""
    if triton is None:
        raise RuntimeError("fp8_grouped_mm_small needs Triton")
    if isinstance(x, QuantRows):
        xq, x_scale, dtype = x
    else:
        if x.stride(1) != 1:
            raise ValueError("fp8_grouped_mm_small needs x contiguous along K")
        (xq, x_scale), dtype = quantize_rows(x, scale_ub), x.dtype
    num_rows, k_dim = xq.shape
    group_rows = num_rows if group_rows is None else group_rows
    knobs = (block_n, block_k, split_k, num_warps, num_stages, reduce_in_kernel,
             routed_slots_in_kernel)
    if gemv is None and any(knob is not None for knob in knobs):
        gemv = False  # a split-K knob named: the caller asks for the split-K kernel
    if gemv_triton.takes(group_rows, gemv):
        return gemv_triton.fp8_gemv(xq, x_scale, dtype, w, w_scale, offs)
    num_experts, n_dim, _ = w.shape
    if xq.stride(1) != 1 or w.stride(2) != 1 or w_scale.stride(1) != 1:
        raise ValueError("fp8_grouped_mm_small needs x, w and w_scale contiguous along K / N")
    if offs is None and num_experts != 1:
        raise ValueError(f"offs=None means one group, got {num_experts} experts")
    tile = tile_for(offs is not None, n_dim, k_dim)
    block_n = tile[0] if block_n is None else block_n
    block_k = tile[1] if block_k is None else block_k
    num_warps = tile[2] if num_warps is None else num_warps
    num_stages = tile[3] if num_stages is None else num_stages
    if split_k is None:
        split_k = split_k_for(num_rows, num_experts, n_dim, k_dim, block_n, block_k,
                              device_sm_count(xq.device))
    k_split = triton.cdiv(triton.cdiv(k_dim, split_k), block_k) * block_k  # whole K blocks
    split_k = triton.cdiv(k_dim, k_split)
    reduce = SPLITK_REDUCE_IN_KERNEL if reduce_in_kernel is None else reduce_in_kernel
    # One slice and no in-kernel sum: the kernel stores the output in x's dtype, where a
    # float32 partial was stored and then cast by another launch (the same rounding)
    direct = split_k == 1 and not reduce
    part = torch.empty(split_k, num_rows, n_dim, dtype=dtype if direct else torch.float32,
                       device=xq.device)
    compact = ROUTED_SLOTS_ENABLED if routed_slots_in_kernel is None else routed_slots_in_kernel
    slots = routed_slots(num_rows, num_experts) if compact else num_experts
    grid = (triton.cdiv(n_dim, block_n), split_k, slots)
    out = torch.empty(num_rows, n_dim, dtype=dtype, device=xq.device) if reduce else part
    counters = tile_counters(xq.device, grid[0] * grid[2]) if reduce else part
    _fp8_splitk_kernel[grid](
        xq, x_scale, w, w_scale, part, xq if offs is None else offs, out, counters, n_dim,
        k_dim, k_split, xq.stride(0), w.stride(0), w.stride(1), w_scale.stride(0),
        part.stride(0), part.stride(1), out.stride(0), num_rows, num_experts,
        HAS_OFFS=offs is not None, ROUTED_SLOTS=compact, REDUCE=reduce, BLOCK_M=FP8_BLOCK_M,
        BLOCK_N=block_n, BLOCK_K=block_k, EXPERTS_POW2=triton.next_power_of_2(num_experts),
        num_warps=num_warps, num_stages=num_stages, **pdl_args(xq))
    if reduce:
        return out
    if direct:
        return part[0]
    if SPLITK_SUM_TRITON and split_k > 1:
        return splitk_sum(part, dtype)
    return part.sum(0).to(dtype)


#: Whether :func:`fp8_grouped_mm_small` adds its K-slices' float32 partials and casts the
#: sum to the output dtype in one Triton launch (:func:`splitk_sum`), where torch runs a
#: sum and then a cast: at a batch-1 step of full-size Scout FP8 those were 192 launches
#: each, 2.7 and 1.1 us (BENCHMARKS.md, fifteenth session).  The slices are added in slice
#: order in float32, rounded once.  Off until an H200 A/B measures it
#: (``CHUNKLOCAL_FP8_SPLITK_SUM=1``; ``benchmarks/switch_ab.py --switches sum``).
SPLITK_SUM_TRITON = os.environ.get("CHUNKLOCAL_FP8_SPLITK_SUM", "0") == "1"
SUM_BLOCK = 1024  # output elements per program


if triton is not None:
    @triton.jit
    def _splitk_sum_kernel(part_ptr, out_ptr, numel, num_splits, stride_ps,
                           BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < numel
        total = tl.load(part_ptr + offs, mask=ok, other=0.0)
        for s in range(1, num_splits):
            total += tl.load(part_ptr + s * stride_ps + offs, mask=ok, other=0.0)
        tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


def splitk_sum(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``part.sum(0).to(dtype)`` of float32 partials ``part [S, M, N]`` (contiguous), in
    one launch: each element's slices added in slice order."""
    if triton is None:
        raise RuntimeError("splitk_sum needs Triton")
    if not part.is_contiguous():
        raise ValueError("splitk_sum needs contiguous partials")
    out = torch.empty(part.shape[1:], dtype=dtype, device=part.device)
    numel = out.numel()
    if numel:
        _splitk_sum_kernel[(triton.cdiv(numel, SUM_BLOCK),)](
            part, out, numel, part.shape[0], part.stride(0), BLOCK=SUM_BLOCK, num_warps=4,
            **pdl_args(part))
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
                               BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
                               **pdl_args(x))
    return out
