"""The MoE block's routing: which experts each token goes to, and the pairs in expert order.

Routing is transformers' ``Llama4Router``: logits ``x @ router.T``, top-k per token, score
``sigmoid(top logit)`` (float32, cast to the activation dtype); the score scales the
expert's *input*.  :func:`route` gives ``(expert, score)``; :func:`sort_pairs_torch` turns
them into what the grouped GEMMs take (the ``(token, slot)`` pairs sorted by expert, the
groups' end rows, each row's token and score); :func:`pairs` picks the fastest path that
runs, and :func:`combine` adds each token's expert outputs back up.

At decode sizes each of those torch ops is its own launch of a few microseconds: about
twenty a layer from the router's logits to the routed sum.  route_triton's kernels do the
same work in two (:data:`route_triton.FUSED_ENABLED`: logits to sorted pairs in one, the
sum in another) or sort the top-k's pairs in one (:data:`route_triton.ROUTE_ENABLED`).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

import chunklocal.models.route_triton as route_triton

#: Simulated routing for runs on dummy weights, whose router sends most tokens of a layer to
#: one or two experts where a trained router spreads them (issue 19), so a benchmark would
#: read a fraction of the expert bytes real traffic reads.  vLLM's
#: ``VLLM_MOE_ROUTING_SIMULATION_STRATEGY`` under our prefix
#: (``CHUNKLOCAL_MOE_ROUTING_SIMULATION_STRATEGY``), read at import, so an engine process
#: started by ``chunklocal serve`` inherits it: "" routes by the weights; "uniform_random"
#: draws each pair's expert uniformly (vLLM's strategy of that name); "balanced" sends pair
#: ``j`` of token ``t`` in the ``i``-th MoE call of the process to expert ``(t * top_k + j +
#: i) mod E``, so a step of ``T`` tokens touches ``min(E, T * top_k)`` experts of every
#: layer (the floor benchmarks count).  Both score the chosen experts with the router's own
#: logits (the router GEMM still runs) and stay on the device, so CUDA graphs capture them.
ROUTING_SIMULATION_STRATEGIES = ("", "uniform_random", "balanced")
ROUTING_SIMULATION = os.environ.get("CHUNKLOCAL_MOE_ROUTING_SIMULATION_STRATEGY", "")
#: Pairs sorted by torch (prefill steps: past route_triton's pair bounds) combined by
#: route_triton.combine_rows too, their ``rank`` the inverse of ``order`` (one scatter of
#: P integers): one read of the rows and one write, where the scatter back to pair order
#: and the sum over the slots move them twice (a 12-layer 8k prefill step on an H100, 29th
#: session: that ``index_copy_`` 1.7 ms and the add 0.9 ms).  The same bits for two slots
#: (one float32 add, one rounding).  With it the shared expert's output (steps where it is
#: not a group of the GEMMs) is added in the same kernel too, where torch's add read both
#: ``[T, H]`` again (0.9 ms of that step): the same bits.  ``CHUNKLOCAL_MOE_COMBINE_RANKED=1``,
#: ``--switches combine_ranked``; off until a GPU A/B.
COMBINE_RANKED = os.environ.get("CHUNKLOCAL_MOE_COMBINE_RANKED", "0") == "1"
if ROUTING_SIMULATION not in ROUTING_SIMULATION_STRATEGIES:
    raise ValueError("CHUNKLOCAL_MOE_ROUTING_SIMULATION_STRATEGY must be one of "
                     f"{', '.join(map(repr, ROUTING_SIMULATION_STRATEGIES))}, got "
                     f"{ROUTING_SIMULATION!r}")
_SIMULATED_CALLS = [0]  # "balanced": MoE calls so far in this process (the rotation)


def router_logits(x: torch.Tensor, router) -> torch.Tensor:
    """[T, E]: ``router`` is its weight [E, H], or the router module (an FP8 checkpoint's
    Fp8Linear)."""
    return router(x) if isinstance(router, nn.Module) else F.linear(x, router)


def route(x: torch.Tensor, router, top_k: int):
    """(expert ids [T, top_k] int64, scores [T, top_k] in x.dtype), as Llama4Router; or
    the :data:`ROUTING_SIMULATION` strategy's experts, scored by their logits."""
    logits = router_logits(x, router)
    if ROUTING_SIMULATION:
        expert = simulated_experts(logits, top_k, ROUTING_SIMULATION)
        return expert, torch.sigmoid(logits.gather(1, expert).float()).to(x.dtype)
    top_logit, expert = torch.topk(logits, top_k, dim=1)
    return expert, torch.sigmoid(top_logit.float()).to(x.dtype)


def simulated_experts(logits: torch.Tensor, top_k: int, strategy: str) -> torch.Tensor:
    """[T, top_k] int64 expert ids of a :data:`ROUTING_SIMULATION` strategy (made on the
    device; the token count is the only shape)."""
    tokens, num_experts = logits.shape
    if strategy == "uniform_random":
        return torch.randint(num_experts, (tokens, top_k), device=logits.device)
    pairs = torch.arange(tokens * top_k, device=logits.device).view(tokens, top_k)
    return (pairs + _balanced_rotation()) % num_experts


def _balanced_rotation() -> int:
    """"balanced": this MoE call's shift, one more than the last call's."""
    _SIMULATED_CALLS[0] += 1
    return _SIMULATED_CALLS[0]


def sort_by_expert(expert: torch.Tensor, num_groups: int):
    """Pairs in expert order.

    ``expert``: [T, k] group id of each (token, slot) pair.  Returns ``order`` [T * k]
    (int64: flat pair index of each sorted row; stable, so rows of one group keep token
    order) and ``offs`` [num_groups] int32, the end row of each group (``offs[-1] ==
    T * k``), as ``torch._grouped_mm`` takes them.  Device-side, no host sync.

    Ids may be ``0 .. num_groups`` (``num_groups``: a pair another rank owns, sorted past
    the end).  They are sorted as the narrowest integer that holds them: torch's CUDA radix
    sort runs its digit passes over every bit of the key type, so int64 ids cost 8x the
    passes of uint8 (the H200's decode step at batch 151 spent 1.29 ms in this sort, 48
    launches, with int64 keys).
    """
    key = (torch.uint8 if num_groups <= torch.iinfo(torch.uint8).max
           else torch.int16 if num_groups <= torch.iinfo(torch.int16).max else torch.int32)
    sorted_expert, order = torch.sort(expert.reshape(-1).to(key), stable=True)
    ids = torch.arange(num_groups, device=expert.device, dtype=key)
    offs = torch.searchsorted(sorted_expert, ids, right=True, out_int32=True)
    return order, offs


def sort_pairs_torch(expert, score, num_groups: int, shared: bool) -> tuple:
    """route_triton.sort_pairs's ``(order, offs, token, pair_score)`` through torch's ops;
    ``shared``: the shared expert as group ``num_groups``, every token, score 1."""
    if shared:
        expert = torch.cat([expert, expert.new_full((expert.shape[0], 1), num_groups)], 1)
        score = torch.cat([score, score.new_ones(score.shape[0], 1)], dim=1)
    order, offs = sort_by_expert(expert, num_groups + int(shared))
    token = order // expert.shape[1] if expert.shape[1] > 1 else order
    return order, offs, token, score.reshape(-1)[order]  # Llama-4 scales the input


def pairs(x: torch.Tensor, router, top_k: int, num_groups: int, shared: bool) -> tuple:
    """``(order, offs, token, pair_score, rank)`` of ``x``'s tokens routed over
    ``num_groups`` experts (this rank's whole set), with ``shared`` the shared expert as
    group ``num_groups`` (score 1): :func:`sort_pairs_torch`'s four, and ``rank [P]`` (the
    row of pair ``t * slots + s``, for :func:`combine`) or None where torch sorted.

    One kernel from the logits (route_triton.route_pairs) where it runs: top-1, the
    weights' routing or "balanced", and its switch on (with the router's GEMM in it too,
    route_triton.route_pairs_from_x, where :data:`route_triton.ROUTER_IN_KERNEL`); else
    :func:`route`, then route_triton.sort_pairs or torch's ops."""
    tokens = x.shape[0]
    count, groups = tokens * (top_k + int(shared)), num_groups + int(shared)
    if top_k == 1 and ROUTING_SIMULATION != "uniform_random" \
            and num_groups <= route_triton.MAX_EXPERTS \
            and route_triton.fused_available(x, count, groups):
        offset = (_balanced_rotation() % num_groups if ROUTING_SIMULATION == "balanced"
                  else None)
        weight = route_triton.router_weight(x, router)
        if weight is not None:  # the router's GEMM in the same launch
            return route_triton.route_pairs_from_x(x, weight, shared, offset)
        return route_triton.route_pairs(router_logits(x, router), num_groups, shared,
                                        x.dtype, offset)
    expert, score = route(x, router, top_k)
    if route_triton.route_available(score, count, groups):
        return route_triton.sort_pairs(expert, score, num_groups, shared)
    return (*sort_pairs_torch(expert, score, num_groups, shared), None)


def combine(rows: torch.Tensor, order: torch.Tensor, rank: torch.Tensor | None,
            tokens: int, slots: int, drop: torch.Tensor | None = None,
            addend: torch.Tensor | None = None) -> torch.Tensor:
    """``[tokens, H]``: each token's ``slots`` expert outputs added up, ``rows [P, H]`` in
    expert order (row ``i`` is pair ``order[i]``), plus ``addend [tokens, H]`` (the shared
    expert's output) if given: torch's ``addend + sum``, the sum rounded to ``rows``' dtype
    first.  One kernel with ``rank`` where it runs (route_triton.combine_rows); else a
    scatter back to pair order, a sum over slots and the add.  ``drop [T, slots]``: pairs
    whose rows are unspecified (another rank's experts), zero."""
    if drop is None and route_triton.combine_available(rows):
        if rank is None and COMBINE_RANKED:  # torch sorted: the rows of pairs 0..P-1
            rank = torch.empty_like(order).scatter_(
                0, order, torch.arange(order.shape[0], device=order.device))
        if rank is not None:
            if addend is None or COMBINE_RANKED:
                return route_triton.combine_rows(rows, rank, tokens, slots, addend)
            return addend + route_triton.combine_rows(rows, rank, tokens, slots)  # as before
    per_slot = torch.empty_like(rows).index_copy_(0, order, rows)
    if drop is not None:
        per_slot = per_slot.masked_fill(drop.reshape(-1, 1), 0)
    routed = per_slot.view(tokens, slots, -1).sum(1) if slots > 1 else per_slot
    return routed if addend is None else addend + routed
