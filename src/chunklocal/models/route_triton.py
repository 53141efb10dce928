"""The MoE block's pair bookkeeping at decode sizes in one Triton launch.

After the router's top-k, :meth:`MoE._block` turns the ``[T, k]`` expert ids and scores into
the grouped GEMMs' inputs: with the shared expert as group E (FP8, at most
``moe.SHARED_GROUP_TOKENS`` tokens) it appends a column of E and a column of ones (a fill and
a cat each), then :func:`moe.sort_by_expert` (a cast to uint8, torch's sort, an arange, a
searchsorted), the token of each sorted pair (a division) and its score (a gather): about
eleven launches a layer, each a few microseconds at batch 1 whatever its size, about 530 in
a decode step of full-size Scout (48 layers).  The H200's batch-1 step spent about 2.9 ms of
its 10.4 busy in some 2,300 such small kernels (BENCHMARKS.md, twentieth session).

:func:`sort_pairs` does all of it in one launch for up to ``MAX_PAIRS`` pairs: one program
loads the pairs' group ids, ranks each pair by (group, flat index) -- a stable sort, as
torch's -- with a ``[P, P]`` comparison, and stores the order, the tokens and the scores at
their ranks and each group's end row.  Only integers move and the scores are copied, so
its outputs equal torch's path bit for bit (tests/test_route_triton.py, in Triton's
interpreter; tests/gpu/test_moe_gpu.py on the GPU).

Off by default (``CHUNKLOCAL_MOE_ROUTE_TRITON=1`` turns it on; ``benchmarks/switch_ab.py
--switches route``): written without a GPU in the twentieth session, it is on only once an
H200 A/B shows the step faster.
"""

from __future__ import annotations

import os

import torch

from chunklocal.models.quant_triton import available, triton

if triton is not None:
    import triton.language as tl

#: The switch, read when a layer runs (``CHUNKLOCAL_MOE_ROUTE_TRITON=1`` turns it on).
ROUTE_ENABLED = os.environ.get("CHUNKLOCAL_MOE_ROUTE_TRITON", "0") == "1"
#: Steps of at most this many (token, slot) pairs sort in the kernel: its ``[P, P]``
#: comparison is P^2 lanes of one program (4,096 at 64: batch 64 at top-1, or 32 tokens with
#: the shared group).  Longer steps keep torch's radix sort.
MAX_PAIRS = 64


def route_available(score: torch.Tensor, pairs: int) -> bool:
    """:func:`sort_pairs` runs for ``pairs`` pairs of scores ``score`` and is switched on."""
    return ROUTE_ENABLED and 0 < pairs <= MAX_PAIRS and available(score)


def sort_pairs(expert: torch.Tensor, score: torch.Tensor, num_groups: int, shared: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, offs, token, pair_score)`` of the ``T * slots`` pairs, as torch's path makes
    them: ``expert [T, k]`` ids in ``0 .. num_groups - 1`` and ``score [T, k]`` the router's;
    with ``shared`` each token gets one more slot, group ``num_groups`` with score 1, so
    ``slots = k + shared`` and ``offs`` has ``num_groups + shared`` ends.

    ``order [P]`` int64: flat pair index ``t * slots + s`` of each row in (group, index)
    order; ``offs`` int32: end row of each group; ``token [P]`` int64: ``order // slots``;
    ``pair_score [P]``: each row's score, ``score``'s dtype."""
    tokens, k = expert.shape
    slots = k + int(shared)
    pairs, groups = tokens * slots, num_groups + int(shared)
    dev = expert.device
    order = torch.empty(pairs, dtype=torch.int64, device=dev)
    token = torch.empty(pairs, dtype=torch.int64, device=dev)
    offs = torch.empty(groups, dtype=torch.int32, device=dev)
    pair_score = torch.empty(pairs, dtype=score.dtype, device=dev)
    _sort_pairs_kernel[(1,)](
        expert.contiguous(), score.contiguous(), order, offs, token, pair_score, pairs,
        num_groups, groups, K=k, SLOTS=slots,
        BLOCK_P=triton.next_power_of_2(pairs), BLOCK_G=triton.next_power_of_2(groups))
    return order, offs, token, pair_score


if triton is not None:

    @triton.jit
    def _sort_pairs_kernel(expert_ptr, score_ptr, order_ptr, offs_ptr, token_ptr,
                           pair_score_ptr, P, SHARED_GROUP, G, K: tl.constexpr,
                           SLOTS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_G: tl.constexpr):
        p = tl.arange(0, BLOCK_P)
        valid = p < P
        t = p // SLOTS
        s = p % SLOTS
        routed = valid & (s < K)
        gid = tl.load(expert_ptr + t * K + s, mask=routed, other=0).to(tl.int32)
        gid = tl.where(s < K, gid, SHARED_GROUP)  # the shared slot
        gid = tl.where(valid, gid, 2147483647)     # past P: after every real group
        sc = tl.load(score_ptr + t * K + s, mask=routed, other=1.0)
        # rank = pairs before this one in (group, flat index) order: a stable sort
        before = (gid[None, :] < gid[:, None]) | ((gid[None, :] == gid[:, None])
                                                    & (p[None, :] < p[:, None]))
        rank = tl.sum(before.to(tl.int32), axis=1)
        tl.store(order_ptr + rank, p.to(tl.int64), mask=valid)
        tl.store(token_ptr + rank, t.to(tl.int64), mask=valid)
        tl.store(pair_score_ptr + rank, sc, mask=valid)
        g = tl.arange(0, BLOCK_G)
        ends = tl.sum((gid[None, :] <= g[:, None]).to(tl.int32), axis=1)
        tl.store(offs_ptr + g, ends, mask=g < G)
