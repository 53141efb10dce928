"""Prefix caching that knows chunk windows (``LLM(enable_prefix_caching=True)``).

Block hashes.  Full blocks of a request's prompt are named by a hash chained from the
first block: ``h_j = H(h_{j-1}, tokens of block j)`` with ``h_{-1} = H("chunklocal",
block_size, extra)`` and ``extra`` the request's ``cache_salt`` (an int from its sha256, 0
without one); the model is one per engine.  ``algo`` (vLLM's ``prefix_caching_hash_algo``):
"builtin" (default) is Python's hash of ``(h_{j-1}, the block's tokens as a tuple)``, the
blocks cut by ``zip`` in C: about 45 us for 256 blocks (a 4k prompt), but 64-bit and not
keyed (a tuple of ints hashes alike in every process; only the root's str hash changes with
PYTHONHASHSEED), so a crafted prompt could collide with another prefix.  "sha256" hashes
``h_{j-1}``'s 32 bytes and the block's tokens as int64 bytes of one buffer (about 1 us a
block): for tenants that must not alias each other's KV (or give them distinct cache salts).
Full blocks of generated tokens are hashed and registered too (as vLLM), so a follow-up
turn that resends the answer hits them: a block is registered once its KV is written (or
being written by the step) and its tokens are known (never with an overlapped step's
placeholder), at the request's next allocation (before stale pages go) or when it is freed;
the samples of a request share the prompt's hashes and chain their own answers.

Hit rule (:func:`find_hit`).  ``P`` cached tokens are a hit when every KV group holds
what the token at ``P`` needs: a global or merged group every block of ``[0, P)``, a
chunked group only the blocks of ``[floor(P / c) * c, P)`` (none when P is a multiple of
c); the longest such whole-block P wins, capped at ``len(tokens) - 1`` rounded down to a
block, so at least one token is computed and the step has logits.

Pages.  Each group's pages have a reference count (block tables holding them).  A
page whose count drops to 0 goes back to the free stack if it has no hash, else to the
group's evictable set (least recently freed first; one request's pages are freed last
block first, so a prefix's tail is evicted before its head).  Allocation takes the
free stack first, then evicts from the evictable set (dropping the page's hash).  A hit
revives evictable pages (count 1) or shares pages in use (count + 1).  A block's hash is
registered when it is scheduled (:meth:`BlockManager.allocate`), as in vLLM: a request
hitting it in the same step reads it after the layer wrote the whole batch's KV.
Registering changes no count (a freed page is available whether free or evictable), so
``decode_changes`` needs no hashing.
"""

from __future__ import annotations

import hashlib
import operator
import struct
from collections import OrderedDict
from dataclasses import dataclass


def salt_key(cache_salt: str | None) -> int:
    """The ``extra`` key of a request's block hashes (0: no salt)."""
    if cache_salt is None:
        return 0
    return int.from_bytes(hashlib.sha256(cache_salt.encode()).digest()[:8], "little") | 1


HASH_ALGOS = ("builtin", "sha256")


def _root(block_size: int, extra: int, algo: str) -> int:
    if algo == "builtin":
        return hash(("chunklocal", block_size, extra))
    seed = b"chunklocal" + struct.pack("<qQ", block_size, extra)
    return int.from_bytes(hashlib.sha256(seed).digest(), "little")


def extend_hashes(hashes: list[int], token_ids, block_size: int, num_blocks: int,
                  extra: int = 0, algo: str = "builtin") -> list[int]:
    """Extend ``hashes`` (the chain of the first blocks of ``token_ids``) to ``num_blocks``
    (module docstring; ``algo``: "builtin" or "sha256")."""
    start = len(hashes)
    if num_blocks <= start:
        return hashes
    parent = hashes[-1] if hashes else _root(block_size, extra, algo)
    span = token_ids[start * block_size:num_blocks * block_size]
    append = hashes.append
    if algo == "builtin":  # zip(*[it] * bs): the blocks as tuples, made in C without slicing
        for block in zip(*[iter(span)] * block_size, strict=True):
            parent = hash((parent, block))
            append(parent)
        return hashes
    if algo != "sha256":
        raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, got {algo!r}")
    buf = struct.pack(f"<{len(span)}q", *span)  # one buffer; each block hashed with its parent
    width, sha256 = 8 * block_size, hashlib.sha256
    for at in range(0, len(buf), width):
        parent = int.from_bytes(sha256(parent.to_bytes(32, "little") + buf[at:at + width])
                                .digest(), "little")
        append(parent)
    return hashes


class PageCache:
    """One KV group's reference counts, page hashes and evictable set."""

    def __init__(self, num_blocks: int):
        self.ref = [0] * num_blocks
        self.page_hash: list[int | None] = [None] * num_blocks
        self.by_hash: dict[int, int] = {}
        #: page -> None, least recently freed first.
        self.evictable: OrderedDict[int, None] = OrderedDict()

    def take(self, free: list[int], count: int) -> list[int]:
        """``count`` pages (count 1): the free stack's first, then evicted cached pages."""
        pages = free[:-count - 1:-1]
        del free[len(free) - len(pages):]
        evictable, page_hash, by_hash = self.evictable, self.page_hash, self.by_hash
        for _ in range(count - len(pages)):
            page = evictable.popitem(last=False)[0]
            block_hash = page_hash[page]
            if block_hash is not None:  # always: evictable pages are cached ones
                del by_hash[block_hash]
            page_hash[page] = None
            pages.append(page)
        ref = self.ref
        for page in pages:
            ref[page] = 1
        return pages

    def release(self, free: list[int], pages) -> None:
        """Drop one reference to each page (last first); unreferenced pages go free."""
        ref, page_hash, evictable = self.ref, self.page_hash, self.evictable
        for page in reversed(pages):
            ref[page] -= 1
            if ref[page] == 0:
                if page_hash[page] is None:
                    free.append(page)
                else:
                    evictable[page] = None

    def gain(self, pages) -> int:
        """Pages that :meth:`release` would make available."""
        ref = self.ref
        return sum(1 for page in pages if ref[page] == 1)

    def share(self, pages) -> None:
        ref, evictable = self.ref, self.evictable
        for page in pages:
            if ref[page] == 0:
                del evictable[page]
            ref[page] += 1

    def register(self, page: int, block_hash: int) -> None:
        if self.page_hash[page] is None and block_hash not in self.by_hash:
            self.by_hash[block_hash] = page
            self.page_hash[page] = block_hash

    def reset(self, free: list[int]) -> None:
        """Forget every hash (after a failed step: pages may be half written)."""
        free.extend(self.evictable)
        self.evictable.clear()
        self.by_hash.clear()
        self.page_hash = [None] * len(self.ref)


@dataclass
class Hit:
    """``num_tokens`` cached tokens; per group the block table (placeholders 0 before
    ``first[g]``), and how many of its pages are revived from the evictable set."""
    num_tokens: int
    tables: list[list[int]]
    first: list[int]
    revived: list[int]


def _first_none(found: list, default: int) -> int:
    """Index of the first None in ``found`` (one scan), else ``default``."""
    try:
        return found.index(None)
    except ValueError:
        return default


def find_hit(groups, hashes: list[int], max_blocks: int) -> Hit | None:
    """The longest prefix of ``hashes[:max_blocks]`` every group holds (module docstring).
    Dictionary probes go through ``map(dict.get)`` (C speed: about 30 us for 256 blocks)."""
    nb = max_blocks
    pages: list = [None] * len(groups)  # per group: pages from its window start (or 0)
    for g, grp in enumerate(groups):  # global / merged: a run of cached blocks from the first
        if grp.chunk_size is None and nb:
            found = list(map(grp.cache.by_hash.get, hashes[:nb]))
            nb = _first_none(found, nb)
            pages[g] = found
    chunked = [g for g, grp in enumerate(groups) if grp.chunk_size is not None]
    while chunked and nb:  # chunked: the window [floor(P / c) * c, P) of the chunk of P
        before = nb
        for g in chunked:  # the first uncached block from the chunk boundary at or below nb
            grp = groups[g]
            lowest = (nb * grp.block_size // grp.chunk_size) * grp.chunk_size // grp.block_size
            found = list(map(grp.cache.by_hash.get, hashes[lowest:nb]))
            nb = lowest + _first_none(found, nb - lowest)
            pages[g] = [None] * lowest + found
        if nb == before or len(chunked) == 1:  # stable
            break
    if nb == 0:
        return None
    tables, first, revived = [], [], []
    for g, grp in enumerate(groups):
        start = 0 if grp.chunk_size is None else \
            (nb * grp.block_size // grp.chunk_size) * grp.chunk_size // grp.block_size
        held = pages[g][start:nb]
        tables.append([0] * start + held)
        first.append(start)
        revived.append(operator.countOf(map(grp.cache.ref.__getitem__, held), 0))
    return Hit(nb * groups[0].block_size, tables, first, revived)
