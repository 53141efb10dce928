"""The MoE block's pair bookkeeping at decode sizes in one Triton launch.

After the router's top-k, :meth:`MoE._block` turns the ``[T, k]`` expert ids and scores into
the grouped GEMMs' inputs: with the shared expert as group E (FP8, at most
``moe.SHARED_GROUP_TOKENS`` tokens) it appends a column of E and a column of ones (a fill and
a cat each), then :func:`routing.sort_by_expert` (a cast to uint8, torch's sort, an arange, a
searchsorted), the token of each sorted pair (a division) and its score (a gather): about
eleven launches a layer, each a few microseconds at batch 1 whatever its size, about 530 in
a decode step of full-size Scout (48 layers).  The H200's batch-1 step spent about 2.9 ms of
its 10.4 busy in some 2,300 such small kernels (BENCHMARKS.md, twentieth session).

:func:`sort_pairs` does all of it in one launch for up to ``MAX_PAIRS`` pairs: one program
loads the pairs' group ids, ranks each pair by (group, flat index) -- a stable sort, as
torch's -- by counting (a cumulative sum of the ``[P, groups]`` one-hot), and stores the
order, the tokens and the scores at their ranks and each group's end row.  Only integers
move and the scores are copied, so its outputs equal torch's path bit for bit
(tests/test_route_triton.py, in Triton's interpreter; tests/gpu/test_moe_gpu.py on the GPU).

On by default (``CHUNKLOCAL_MOE_ROUTE_TRITON=0`` turns it off; ``benchmarks/switch_ab.py
--switches route``): written without a GPU in the twentieth session; on an H100 in the
twenty-first (12 of full-size Scout FP8's layers, spread routing, 3 alternated rounds) the
graph replay took 0.92x at batch 1 and 0.978x at 16, outside the rounds' spread
(BENCHMARKS.md, "Twenty-first session").

:func:`route_pairs` goes one launch further back: from the router's logits of a top-1 layer
(Scout and Maverick) it takes each token's expert (the largest logit, the lowest index on
a tie) or the "balanced" simulation's, and its score (``sigmoid`` in float32, rounded to
the activation dtype), then sorts as above; torch's top-k, sigmoid and cast (or the
simulation's arange, add, remainder, gather, sigmoid and cast) are gone.  It also returns
each pair's row, ``rank``, so :func:`combine_rows` adds each token's expert outputs in one
launch where torch scattered them back to pair order and summed over the slots.  The
sigmoid's exp is Triton's, so a score may differ from torch's by a unit or two in the
last place of the activation dtype; the experts, the order and the sums are torch's exactly
(tests/test_route_triton.py).  On by default (``CHUNKLOCAL_MOE_ROUTE_FUSED=0`` turns it
off; ``--switches route_fused``): in the same H100 A/B the replay took 0.852x at batch 1
and 0.952x at 16, outside the spread, and tests/gpu/test_fp8_gpu.py's engine tokens held
with both kernels on.
"""

from __future__ import annotations

import os

import torch

from chunklocal.models.moe_triton import tile_counters
from chunklocal.models.quant_triton import available, pdl_args, triton

if triton is not None:
    import triton.language as tl

    from chunklocal.models.quant_triton import pdl_start

#: The switch, read when a layer runs (``CHUNKLOCAL_MOE_ROUTE_TRITON=0`` turns it off).
ROUTE_ENABLED = os.environ.get("CHUNKLOCAL_MOE_ROUTE_TRITON", "1") == "1"
#: Steps of at most this many (token, slot) pairs sort in the kernel (one program; batch 64
#: at top-1, or 32 tokens with the shared group): the size the H100 A/B measured.  Longer
#: steps keep torch's radix sort, unless :data:`WIDE_ENABLED`.
MAX_PAIRS = 64
#: Wider steps in the kernel too (``CHUNKLOCAL_MOE_ROUTE_WIDE=1``; ``--switches route_wide``):
#: up to :data:`MAX_WIDE_PAIRS` pairs while the ``[P, groups]`` tile of the counting sort
#: stays within :data:`MAX_LANES` (Scout: 512 pairs with the shared group, 1,024 without;
#: Maverick: 64 and 128).  Off until an A/B at batch 64-256 measures it.
WIDE_ENABLED = os.environ.get("CHUNKLOCAL_MOE_ROUTE_WIDE", "0") == "1"
MAX_WIDE_PAIRS = 1024
MAX_LANES = 16384
#: :func:`route_pairs` and :func:`combine_rows`' switch (``CHUNKLOCAL_MOE_ROUTE_FUSED=0``
#: turns it off), read when a layer runs.
FUSED_ENABLED = os.environ.get("CHUNKLOCAL_MOE_ROUTE_FUSED", "1") == "1"
#: Experts a top-1 layer may have for :func:`route_pairs`: its ``[P, E]`` tile of logits
#: (Maverick's 128 at 64 pairs: 8,192 lanes of one program).
MAX_EXPERTS = 128
COMBINE_BLOCK = 1024  # hidden elements per combine program
#: The router's GEMM inside :func:`route_pairs`' launch (:func:`route_pairs_from_x`;
#: ``CHUNKLOCAL_MOE_ROUTER_IN_KERNEL=1``, ``--switches router``): at batch 1 cuBLAS runs
#: the router as a split-K GEMM and its reduce, two launches a layer (about 6 us on an H100,
#: 0.3 ms a full-size step).  Here each program multiplies one K-slice of every token's row
#: by the router and the last to finish (a ticket, as moe_triton's in-kernel sum) adds the
#: slices in slice order, rounds the logits to the activations' dtype and routes and sorts
#: as :func:`route_pairs`.  The sum's order is not cuBLAS's, so a logit may differ in its
#: last place and a near-tie route the other way.  On by default since the 28th session
#: (full-size Scout FP8 batch-1 replay 0.975x of PDL + partial sums on the H200, 27th; the
#: engine's token tests pass with it, H100, 28th); ``=0`` turns it off.
ROUTER_IN_KERNEL = os.environ.get("CHUNKLOCAL_MOE_ROUTER_IN_KERNEL", "1") == "1"
ROUTER_BLOCK_K = 128  # hidden elements per program (Scout: 40 programs)


def max_pairs(groups: int) -> int:
    """The most pairs the kernels take for ``groups`` groups (experts, and the shared one)."""
    if not WIDE_ENABLED:
        return MAX_PAIRS
    return min(MAX_WIDE_PAIRS, MAX_LANES // _pow2(groups))


def _pow2(n: int) -> int:
    """The least power of two >= n (triton.next_power_of_2, without Triton)."""
    return 1 << max(0, n - 1).bit_length()


def _warps(pairs: int, groups: int) -> int:
    """Warps of the one program: more where its [P, groups] tile is wide."""
    return 8 if _pow2(pairs) * _pow2(groups) > 4096 else 4


def route_available(score: torch.Tensor, pairs: int, groups: int) -> bool:
    """:func:`sort_pairs` runs for ``pairs`` pairs over ``groups`` groups, scores ``score``,
    and is switched on."""
    return ROUTE_ENABLED and 0 < pairs <= max_pairs(groups) and available(score)


def fused_available(x: torch.Tensor, pairs: int, groups: int) -> bool:
    """:func:`route_pairs` and :func:`combine_rows` run for ``pairs`` pairs over ``groups``
    groups of activations ``x`` and are switched on (the caller checks top-1 and the
    experts' count)."""
    return FUSED_ENABLED and 0 < pairs <= max_pairs(groups) and available(x)


def router_weight(x: torch.Tensor, router) -> torch.Tensor | None:
    """The router's weight ``[E, H]`` where :func:`route_pairs_from_x` takes it for ``x``
    (switched on, no bias, x's dtype, both contiguous), else None."""
    weight = router if isinstance(router, torch.Tensor) else getattr(router, "weight", None)
    if (not ROUTER_IN_KERNEL or not isinstance(weight, torch.Tensor)
            or getattr(router, "bias", None) is not None or weight.dtype != x.dtype
            or weight.dim() != 2 or weight.shape[1] != x.shape[1]
            or not (weight.is_contiguous() and x.is_contiguous())):
        return None
    return weight


def combine_available(rows: torch.Tensor) -> bool:
    """:func:`combine_rows` runs on ``rows`` and is switched on."""
    return FUSED_ENABLED and available(rows) and rows.is_contiguous()


def _outputs(pairs: int, groups: int, dtype: torch.dtype, dev: torch.device):
    """``(order, offs, token, pair_score, rank)`` for the kernels to fill."""
    def long():
        return torch.empty(pairs, dtype=torch.int64, device=dev)
    return (long(), torch.empty(groups, dtype=torch.int32, device=dev), long(),
            torch.empty(pairs, dtype=dtype, device=dev), long())


def sort_pairs(expert: torch.Tensor, score: torch.Tensor, num_groups: int, shared: bool
               ) -> tuple[torch.Tensor, ...]:
    """``(order, offs, token, pair_score)`` of the ``T * slots`` pairs, as torch's path makes
    them: ``expert [T, k]`` ids in ``0 .. num_groups - 1`` and ``score [T, k]`` the router's;
    with ``shared`` each token gets one more slot, group ``num_groups`` with score 1, so
    ``slots = k + shared`` and ``offs`` has ``num_groups + shared`` ends.

    ``order [P]`` int64: flat pair index ``t * slots + s`` of each row in (group, index)
    order; ``offs`` int32: end row of each group; ``token [P]`` int64: ``order // slots``;
    ``pair_score [P]``: each row's score, ``score``'s dtype; ``rank [P]`` int64: the row of
    pair ``p`` (``order[rank[p]] == p``)."""
    tokens, k = expert.shape
    slots = k + int(shared)
    pairs, groups = tokens * slots, num_groups + int(shared)
    out = _outputs(pairs, groups, score.dtype, expert.device)
    _sort_pairs_kernel[(1,)](
        expert.contiguous(), score.contiguous(), *out, pairs, num_groups, groups, K=k,
        SLOTS=slots, BLOCK_P=_pow2(pairs), BLOCK_G=_pow2(groups),
        num_warps=_warps(pairs, groups), **pdl_args(expert))
    return out


def route_pairs(logits: torch.Tensor, num_groups: int, shared: bool, dtype: torch.dtype,
                balanced_offset: int | None = None) -> tuple[torch.Tensor, ...]:
    """:func:`sort_pairs`'s five outputs for a top-1 layer, from the router's ``logits [T,
    E]`` (``E == num_groups``): each token's expert is its largest logit (the lowest index
    on a tie), or with ``balanced_offset`` the "balanced" simulation's ``(t +
    balanced_offset) mod E``; its score ``sigmoid`` of that logit in float32, rounded to
    ``dtype``.  ``shared``: the shared expert as group E, score 1."""
    tokens, num_experts = logits.shape
    if num_experts != num_groups or num_experts > MAX_EXPERTS:
        raise ValueError(f"route_pairs: logits of {num_experts} experts for {num_groups} "
                         f"groups (at most MAX_EXPERTS={MAX_EXPERTS})")
    slots = 1 + int(shared)
    pairs, groups = tokens * slots, num_groups + int(shared)
    out = _outputs(pairs, groups, dtype, logits.device)
    logits = logits.contiguous()
    _route_pairs_kernel[(1,)](
        logits, *out, pairs, num_experts, groups, balanced_offset or 0, SLOTS=slots,
        BALANCED=balanced_offset is not None, BLOCK_P=_pow2(pairs), BLOCK_E=_pow2(num_experts),
        BLOCK_G=_pow2(groups), num_warps=_warps(pairs, groups), **pdl_args(logits))
    return out


def route_pairs_from_x(x: torch.Tensor, weight: torch.Tensor, shared: bool,
                       balanced_offset: int | None = None) -> tuple[torch.Tensor, ...]:
    """:func:`route_pairs` of the logits ``x @ weight.T`` (``x [T, H]``, the router's
    ``weight [E, H]``), the GEMM in the same launch: float32 sums of ``ROUTER_BLOCK_K``
    slices, added in slice order and rounded to ``x``'s dtype."""
    tokens, hidden = x.shape
    num_experts = weight.shape[0]
    if num_experts > MAX_EXPERTS or weight.shape[1] != hidden:
        raise ValueError(f"route_pairs_from_x: a router {tuple(weight.shape)} for rows of "
                         f"{hidden} (at most MAX_EXPERTS={MAX_EXPERTS} experts)")
    slots = 1 + int(shared)
    pairs, groups = tokens * slots, num_experts + int(shared)
    out = _outputs(pairs, groups, x.dtype, x.device)
    splits = triton.cdiv(hidden, ROUTER_BLOCK_K)
    part = torch.empty(splits, tokens, num_experts, dtype=torch.float32, device=x.device)
    # moe_triton's zeroed ticket counters, which every call leaves zeroed (one stream)
    counter = tile_counters(x.device, 1)
    if tokens:
        _router_pairs_kernel[(splits,)](
            x, weight, part, counter, *out, tokens, hidden, pairs, num_experts, groups,
            balanced_offset or 0, x.stride(0), SLOTS=slots,
            BALANCED=balanced_offset is not None, IEEE=x.dtype == torch.float32,
            BLOCK_T=max(16, _pow2(tokens)), BLOCK_E=max(16, _pow2(num_experts)),
            BLOCK_K=ROUTER_BLOCK_K, BLOCK_P=_pow2(pairs), BLOCK_G=_pow2(groups),
            num_warps=_warps(pairs, groups), **pdl_args(x))
    return out


def combine_rows(rows: torch.Tensor, rank: torch.Tensor, tokens: int, slots: int,
                 addend: torch.Tensor | None = None) -> torch.Tensor:
    """``[tokens, H]``: row ``t`` the sum of ``rows[rank[t * slots + s]]`` over the slots,
    in float32 in slot order, rounded once to ``rows``' dtype (torch's sum over the slots of
    the rows scattered back to pair order); plus ``addend[t]`` (``[tokens, H]``, rows'
    dtype) if given, in float32 and rounded once more: torch's ``addend + sum``."""
    hidden = rows.shape[1]
    if addend is not None and (addend.shape != (tokens, hidden) or addend.dtype != rows.dtype
                               or addend.stride(-1) != 1):
        raise ValueError(f"addend must be [{tokens}, {hidden}] {rows.dtype} with contiguous "
                         f"rows, got {tuple(addend.shape)} {addend.dtype}")
    out = torch.empty(tokens, hidden, dtype=rows.dtype, device=rows.device)
    if tokens:
        block = min(COMBINE_BLOCK, triton.next_power_of_2(hidden))
        _combine_kernel[(tokens, triton.cdiv(hidden, block))](
            rows, rank, out, out if addend is None else addend, hidden, rows.stride(0),
            out.stride(0), out.stride(0) if addend is None else addend.stride(0),
            SLOTS=slots, ADD=addend is not None, BLOCK=block, **pdl_args(rows))
    return out


if triton is not None:

    @triton.jit
    def _sort_pairs_kernel(expert_ptr, score_ptr, order_ptr, offs_ptr, token_ptr,
                           pair_score_ptr, rank_ptr, P, SHARED_GROUP, G, K: tl.constexpr,
                           SLOTS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_G: tl.constexpr,
                           PDL: tl.constexpr):
        pdl_start(PDL)
        p = tl.arange(0, BLOCK_P)
        valid = p < P
        t = p // SLOTS
        s = p % SLOTS
        routed = valid & (s < K)
        gid = tl.load(expert_ptr + t * K + s, mask=routed, other=0).to(tl.int32)
        gid = tl.where(s < K, gid, SHARED_GROUP)  # the shared slot
        gid = tl.where(valid, gid, 2147483647)     # past P: after every real group
        sc = tl.load(score_ptr + t * K + s, mask=routed, other=1.0)
        _sort_pairs_store(gid, p, t, sc, valid, order_ptr, offs_ptr, token_ptr, pair_score_ptr,
                          rank_ptr, G, BLOCK_G)

    @triton.jit
    def _sort_pairs_store(gid, p, t, sc, valid, order_ptr, offs_ptr, token_ptr, pair_score_ptr,
                          rank_ptr, G, BLOCK_G: tl.constexpr):
        # A counting sort, stable as torch's: a pair's row is its group's start plus the
        # pairs of its group before it (a cumulative sum of the [P, G] one-hot down P).
        # Pairs past P (group 2**31 - 1) match no column and are not stored.
        g = tl.arange(0, BLOCK_G)
        onehot = (gid[:, None] == g[None, :]).to(tl.int32)
        counts = tl.sum(onehot, axis=0)
        ends = tl.cumsum(counts, 0)
        before = tl.cumsum(onehot, 0) - 1 + (ends - counts)[None, :]
        rank = tl.sum(onehot * before, axis=1)
        tl.store(order_ptr + rank, p.to(tl.int64), mask=valid)
        tl.store(token_ptr + rank, t.to(tl.int64), mask=valid)
        tl.store(pair_score_ptr + rank, sc.to(pair_score_ptr.dtype.element_ty), mask=valid)
        tl.store(rank_ptr + p, rank.to(tl.int64), mask=valid)
        tl.store(offs_ptr + g, ends, mask=g < G)

    # the simulation's offset changes every call: no recompiles for its value
    @triton.jit(do_not_specialize=["offset"])
    def _route_pairs_kernel(logits_ptr, order_ptr, offs_ptr, token_ptr, pair_score_ptr,
                            rank_ptr, P, E, G, offset, SLOTS: tl.constexpr,
                            BALANCED: tl.constexpr, BLOCK_P: tl.constexpr,
                            BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
        p = tl.arange(0, BLOCK_P)
        valid = p < P
        t = p // SLOTS
        routed = valid & (p % SLOTS == 0)  # slot 0: the expert; slot 1: the shared one
        e = tl.arange(0, BLOCK_E)
        logit = tl.load(logits_ptr + t[:, None] * E + e[None, :],
                        mask=routed[:, None] & (e[None, :] < E),
                        other=float("-inf")).to(tl.float32)
        _route_pairs_select(logit, e, p, t, valid, routed, E, offset, order_ptr, offs_ptr,
                            token_ptr, pair_score_ptr, rank_ptr, G, BALANCED, BLOCK_E,
                            BLOCK_G)

    @triton.jit
    def _route_pairs_select(logit, e, p, t, valid, routed, E, offset, order_ptr, offs_ptr,
                            token_ptr, pair_score_ptr, rank_ptr, G, BALANCED: tl.constexpr,
                            BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr):
        # logit [P, E] float32, -inf off the routed pairs and past E
        if BALANCED:  # pair t * top_k + 0 of the call: expert (t + offset) mod E
            gid = (t + offset) % E
            top = tl.sum(tl.where(e[None, :] == gid[:, None], logit, 0.0), axis=1)
        else:
            top = tl.max(logit, axis=1)
            gid = tl.min(tl.where(logit == top[:, None], e[None, :], BLOCK_E), axis=1)
        sc = tl.where(routed, 1.0 / (1.0 + tl.exp(-top)), 1.0)
        gid = tl.where(routed, gid, E)  # the shared slot is group E
        gid = tl.where(valid, gid, 2147483647)  # past P: after every real group
        _sort_pairs_store(gid, p, t, sc, valid, order_ptr, offs_ptr, token_ptr, pair_score_ptr,
                          rank_ptr, G, BLOCK_G)

    @triton.jit(do_not_specialize=["offset"])
    def _router_pairs_kernel(x_ptr, w_ptr, part_ptr, count_ptr, order_ptr, offs_ptr,
                             token_ptr, pair_score_ptr, rank_ptr, T, H, P, E, G, offset,
                             stride_x, SLOTS: tl.constexpr, BALANCED: tl.constexpr,
                             IEEE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                             BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
                             BLOCK_G: tl.constexpr, PDL: tl.constexpr):
        split = tl.program_id(0)
        rows = tl.arange(0, BLOCK_T)
        e = tl.arange(0, BLOCK_E)
        k = split * BLOCK_K + tl.arange(0, BLOCK_K)
        # the router's weights are written by no kernel of the step: read before the wait
        wk = tl.load(w_ptr + e[None, :] * H + k[:, None],
                     mask=(e < E)[None, :] & (k < H)[:, None], other=0.0)
        pdl_start(PDL)
        xk = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :],
                     mask=(rows < T)[:, None] & (k < H)[None, :], other=0.0)
        if IEEE:  # float32 rows: no TF32
            acc = tl.dot(xk, wk, input_precision="ieee")
        else:
            acc = tl.dot(xk, wk)
        tl.store(part_ptr + split * T * E + rows[:, None] * E + e[None, :], acc,
                 mask=(rows < T)[:, None] & (e < E)[None, :])
        tl.debug_barrier()  # every thread's partial stored before the ticket (release)
        ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(0) - 1:  # the last slice in: add, route, sort
            p = tl.arange(0, BLOCK_P)
            valid = p < P
            t = p // SLOTS
            routed = valid & (p % SLOTS == 0)
            ok = routed[:, None] & (e < E)[None, :]
            logit = tl.zeros((BLOCK_P, BLOCK_E), dtype=tl.float32)
            for s in range(0, tl.num_programs(0)):  # L2 (.cg): other programs' stores
                logit += tl.load(part_ptr + s * T * E + t[:, None] * E + e[None, :],
                                 mask=ok, other=0.0, cache_modifier=".cg")
            logit = logit.to(x_ptr.dtype.element_ty).to(tl.float32)  # the router's output
            logit = tl.where(ok, logit, float("-inf"))
            _route_pairs_select(logit, e, p, t, valid, routed, E, offset, order_ptr, offs_ptr,
                                token_ptr, pair_score_ptr, rank_ptr, G, BALANCED, BLOCK_E,
                                BLOCK_G)
            tl.store(count_ptr, 0)  # ready for the next call on this stream

    @triton.jit
    def _combine_kernel(rows_ptr, rank_ptr, out_ptr, add_ptr, H, stride_r, stride_o,
                        stride_a, SLOTS: tl.constexpr, ADD: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
        pdl_start(PDL)
        t = tl.program_id(0)
        h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = h < H
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SLOTS):
            row = tl.load(rank_ptr + t * SLOTS + s)
            total += tl.load(rows_ptr + row * stride_r + h, mask=ok, other=0.0).to(tl.float32)
        routed = total.to(out_ptr.dtype.element_ty)
        if ADD:  # torch rounds the sum to the rows' dtype before ``addend + sum``
            extra = tl.load(add_ptr + t.to(tl.int64) * stride_a + h, mask=ok, other=0.0)
            routed = (routed.to(tl.float32) + extra.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t.to(tl.int64) * stride_o + h, routed, mask=ok)
