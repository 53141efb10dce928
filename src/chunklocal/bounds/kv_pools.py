"""How many KV pages each group's pool gets: the one planner the engine and ``chunklocal plan``
share (pure arithmetic, no torch: a spec is anything with ``page_size_bytes`` and, for a
chunked layer kind, ``attention_chunk_size``; :class:`PageShape` is the plain one).

A hybrid engine has one group per layer kind (global, chunked); a merged one a single group
that keeps every page.  ``num_kv_blocks`` (given, or from a memory budget) sizes the global
or merged pool; a chunked pool never needs more than ``max_num_seqs`` times one request's
need, :func:`chunked_request_pages`.

**Bound** (:func:`chunked_request_pages`).  A chunked group holds, for a request whose step
covers positions ``[s - q, s)`` (``1 <= q <= T``, ``s <= L``), the pages from the start of
the chunk of position ``s - q`` through position ``s - 1``; pages before that chunk are
freed.  That chunk starts at ``s - q - o`` with ``o = (s - q) mod c <= c - 1``, a multiple
of ``bs`` (``c % bs == 0``), so the held pages are ``cdiv(o + q, bs) <= cdiv(c - 1 + T, bs)``,
and never more than the whole sequence, ``cdiv(L, bs)``.  Both are attained (``o = c - 1``,
``q = T`` when ``L >= c - 1 + T``).  This is the per-request term of
:func:`~chunklocal.bounds.closed_forms.max_local_pages` (``min(P + cdiv(q - 1, bs), Lp)``
with ``P = c / bs``, and ``P + cdiv(T - 1, bs) = cdiv(c - 1 + T, bs)``), so the bound is
that closed form for one request: ``max_local_pages(1, T, c, L, bs)``.  Checked by brute
force in tests/test_kv_pools.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chunklocal._validate import cdiv
from chunklocal.bounds.closed_forms import max_local_pages
from chunklocal.kv_spec import Kind, chunk_size_of

KV_MEMORY_FRACTION = 0.4  # of free GPU memory / available RAM, when num_kv_blocks is None
GIB = 2**30


@dataclass(frozen=True)
class PageShape:
    """The part of a KV spec the planner reads: bytes of K and V of one page of one layer."""

    page_size_bytes: int
    attention_chunk_size: int | None = None


@dataclass(frozen=True)
class PoolPlan:
    """One KV group's pool: ``pages`` pages (plus one scratch page) for ``layers`` layers."""

    name: str
    kinds: tuple[Kind, ...]
    pages: int
    need: int  # pages one request of max_model_len holds at most
    layers: int
    page_bytes: int  # one page of every layer of the group, K and V
    bytes: int  # (pages + 1) * page_bytes: the scratch page included

    def requests_fit(self) -> int:
        """How many requests of max_model_len the pool holds at once."""
        return self.pages // self.need


@dataclass(frozen=True)
class KVPoolPlan:
    groups: tuple[PoolPlan, ...]
    num_kv_blocks: int
    total_bytes: int

    @property
    def kind_to_group(self) -> dict[Kind, int]:
        return {kind: i for i, g in enumerate(self.groups) for kind in g.kinds}

    def requests_fit(self) -> int:
        """Requests of max_model_len every pool holds at once (the smallest group's count)."""
        return min(g.requests_fit() for g in self.groups)


def chunked_request_pages(chunk_size: int, max_num_batched_tokens: int, max_model_len: int,
                          block_size: int) -> int:
    """Most pages a chunked group holds for one request: min(cdiv(c - 1 + T, bs), cdiv(L, bs)).

    Proof in the module docstring; it is :func:`max_local_pages` of one request."""
    return max_local_pages(1, max_num_batched_tokens, chunk_size, max_model_len, block_size)


def _budget_pages(pools: list[tuple[int, int]], budget: int) -> list[int]:
    """Pages per pool from ``budget`` bytes, given each pool's (bytes per page, cap): one
    scratch page each first, then equal page counts until the pool of the smallest cap is
    full, and what that cap leaves to the next (largest cap last: the global pool takes
    the chunked pool's remainder, the bug of capping after an equal split)."""
    left = budget - sum(page for page, _ in pools)
    order = sorted(range(len(pools)), key=lambda i: pools[i][1])
    pages = [0] * len(pools)
    for n, i in enumerate(order):
        rest = order[n:]
        equal = max(left, 0) // sum(pools[j][0] for j in rest)
        pages[i] = min(pools[i][1], equal)
        left -= pages[i] * pools[i][0]
    return pages


def plan_kv_pools(layers_of: dict[Kind, int], specs: dict[Kind, Any], *, hybrid: bool,
                  max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                  block_size: int, available: int, num_kv_blocks: int | None = None,
                  weight_bytes: int = 0, reserved_bytes: int = 0,
                  fraction: float = KV_MEMORY_FRACTION, device: str = "cpu",
                  budget_note: str | None = None) -> KVPoolPlan:
    """The pools an engine of these limits allocates, or the ValueError it refuses with.

    ``layers_of``: layers of each kind; ``specs``: each kind's spec (one rank's KV heads);
    ``available``: bytes for weights, activations and KV; ``num_kv_blocks`` None: pools
    from a budget of ``fraction`` of what the weights and ``reserved_bytes`` (activations,
    CUDA graphs) leave, scratch pages included, each pool capped at ``max_num_seqs``
    requests' need (what a capped pool leaves goes to the others); ``budget_note`` says
    where that budget comes from in the messages.  ``device``: named in the messages
    (``cuda:0``; its type is the part before ``:``)."""
    device_type = device.split(":")[0]
    whole_seq = cdiv(max_model_len, block_size)
    kinds = [kind for kind in Kind if kind in specs]
    separate = hybrid or len(kinds) == 1
    shapes: list[tuple[str, tuple[Kind, ...], int, int, int]] = []
    # (name, kinds, need, layers, bytes of one page of the group) per pool
    for kind in kinds if separate else ():
        chunk = chunk_size_of(specs[kind])
        need = chunked_request_pages(chunk, max_num_batched_tokens, max_model_len,
                                     block_size) if chunk else whole_seq
        shapes.append((kind.value, (kind,), need, layers_of[kind],
                       specs[kind].page_size_bytes * layers_of[kind]))
    if not separate:
        shapes.append(("merged", tuple(kinds), whole_seq, sum(layers_of[k] for k in kinds),
                       sum(specs[k].page_size_bytes * layers_of[k] for k in kinds)))
    if num_kv_blocks is None:
        if weight_bytes + reserved_bytes > available:
            # reserved: activations, graphs, non-torch memory, torch's stranded cache and
            # headroom; the note (a profiled budget's) says how much of each
            extra = f" and {reserved_bytes / GIB:.1f} GiB more is reserved beside them" \
                if reserved_bytes else ""
            where = f" [{budget_note}]" if budget_note and reserved_bytes else ""
            raise ValueError(f"the weights need {weight_bytes / GIB:.1f} GiB{extra}, "
                             f"{available / GIB:.1f} GiB is available on {device}{where}")
        budget = int((available - weight_bytes - reserved_bytes) * fraction)
        note = budget_note or (f"{fraction:.0%} of the memory available on {device_type} "
                               f"after the weights")
        one = sum((need + 1) * page for _, _, need, _, page in shapes)
        if one > budget:
            # The longest max_model_len that fits: whole-sequence pools take what the
            # (at most as large) per-request need of the others leaves.
            fixed = sum((need + 1) * page for _, _, need, _, page in shapes if need < whole_seq)
            per = sum(page for _, _, need, _, page in shapes if need >= whole_seq)
            fits = max(budget - fixed, 0) // per - 1 if per else 0
            raise ValueError(
                f"one request of max_model_len {max_model_len} needs {one / GIB:.1f} GiB of "
                f"KV cache, more than the default budget of {budget / GIB:.1f} GiB "
                f"({note}): pass max_model_len <= {max(fits, 0) * block_size} or an "
                f"explicit num_kv_blocks")
        sizes = _budget_pages([(page, max_num_seqs * need) for *_, need, _, page in shapes],
                              budget)
        num_kv_blocks = sizes[-1]  # the global (or merged, or only) pool
    else:
        num_kv_blocks = int(num_kv_blocks)
        sizes = [min(num_kv_blocks, max_num_seqs * need) if need < whole_seq
                 else num_kv_blocks for _, _, need, _, _ in shapes]
    groups = tuple(PoolPlan(name, kinds_, size, need, layers, page, (size + 1) * page)
                   for (name, kinds_, need, layers, page), size in zip(shapes, sizes,
                                                                       strict=True))
    # num_kv_blocks sizes every group, so the smallest that works is the largest need.
    largest = max(groups, key=lambda g: g.need)
    if num_kv_blocks < largest.need:
        raise ValueError(
            f"num_kv_blocks={num_kv_blocks} cannot hold one request: the {largest.name} KV "
            f"group needs {largest.need} blocks of {block_size} tokens (max_model_len "
            f"{max_model_len}, max_num_batched_tokens {max_num_batched_tokens}); "
            f"pass num_kv_blocks >= {largest.need}, or max_model_len <= "
            f"{num_kv_blocks * block_size} fits")
    # One scratch page per group past the pool (KVGroup.scratch_page), every layer's K and V.
    kv_bytes = sum(g.bytes for g in groups)
    if kv_bytes + weight_bytes + reserved_bytes > available:
        # Said as totals: with another engine's weights on the device, ``available`` can
        # be below this engine's weights, and "the -87.3 GiB available" read as a bug.
        extra = f" and {reserved_bytes / GIB:.1f} GiB of activations" if reserved_bytes else ""
        room = available - weight_bytes - reserved_bytes
        left = f"{room / GIB:.1f} GiB left for KV" if room > 0 else "no room left for KV"
        raise ValueError(
            f"num_kv_blocks={num_kv_blocks} needs {kv_bytes / GIB:.1f} GiB of KV cache, "
            f"more than fits: {available / GIB:.1f} GiB is available on {device_type}, "
            f"{weight_bytes / GIB:.1f} GiB of weights{extra} take it first ({left}); pass "
            f"a smaller num_kv_blocks or free the device")
    return KVPoolPlan(groups, num_kv_blocks, kv_bytes)
