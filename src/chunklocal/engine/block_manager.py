"""Paged KV pools, one per KV-cache group, each with its own free list.

Hybrid mode has a global group (NoPE layers, keep every page) and a chunked
group (RoPE layers).  A chunked group only ever reads the chunk of the step's
first query, so before each allocation it frees the pages wholly before
``(num_computed // c) * c``: a long request holds about ``c`` + in-flight tokens
of local KV.  Merged mode has one group whose spec carries the chunk size but
also global layers (``needs_global_pages``), so it keeps every page.

Allocation is all-or-nothing across groups: every caller (the scheduler)
checks :meth:`can_allocate` first and :meth:`allocate` then cannot fail, so a
request that has to wait or be preempted leaves every pool exactly as it was.

Each free list is a Python list used as a stack: pages are taken from and
given back at its end in one slice, never one ``popleft`` per page.

With prefix caching (``prefix_caching=True``, engine/prefix_cache.py) pages are
shared by reference count: a freed page with a block hash waits in its group's
evictable set, allocation takes free pages first and then evicts, and an admitted
request's table starts with the pages of its cache hit (:meth:`lookup`).

Each running request also owns a row of a persistent numpy block table per
group (``tables[g][seq.row]``), written only when pages change, so a step's
block table is one fancy-index gather instead of a loop over requests.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from chunklocal._validate import cdiv
from chunklocal.engine.prefix_cache import HASH_ALGOS, Hit, PageCache, extend_hashes, find_hit
from chunklocal.engine.sequence import Sequence
from chunklocal.kv_spec import FullAttentionSpec, chunk_size_of, needs_global_pages


def available_memory(device) -> int:
    """Bytes the KV cache could take: free GPU memory, or the RAM Linux reports available
    (MemAvailable; total RAM where /proc/meminfo is absent)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class KVGroup:
    spec: FullAttentionSpec
    num_blocks: int

    def __post_init__(self):
        self.block_size = self.spec.block_size
        #: Chunk size the group frees pages by; None when some layer reading the
        #: group attends whole sequences, so it keeps every page.
        self.chunk_size = None if needs_global_pages(self.spec) else chunk_size_of(self.spec)
        # Reversed so a fresh pool hands out pages 0, 1, 2, ... in order.
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self.peak_used = 0
        #: Reference counts, hashes and evictable pages (None: prefix caching off).
        self.cache: PageCache | None = None

    @property
    def scratch_page(self) -> int:
        """A page past the pool: padding rows of graph steps write and read only it."""
        return self.num_blocks

    @property
    def num_free(self) -> int:
        """Pages an allocation may take: the free stack and the evictable cached pages."""
        return len(self.free_blocks) + (0 if self.cache is None else len(self.cache.evictable))

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def take(self, count: int) -> list[int]:
        """``count`` (> 0) pages for a table: the free stack's last (a stack: one slice),
        then, with prefix caching, evicted cached pages."""
        if self.cache is not None:
            return self.cache.take(self.free_blocks, count)
        free = self.free_blocks
        pages = free[:-count - 1:-1]
        del free[-count:]
        return pages

    def release(self, pages) -> None:
        """Give pages back: onto the free stack, or (prefix caching) one reference each."""
        if self.cache is None:
            self.free_blocks.extend(pages)
        else:
            self.cache.release(self.free_blocks, pages)

    def stale_pages(self, seq: Sequence, g: int) -> int:
        """Pages of ``seq`` no future query of this group can read (freed next allocation)."""
        if self.chunk_size is None:
            return 0
        chunk_start_page = (seq.num_computed // self.chunk_size) * self.chunk_size
        chunk_start_page //= self.block_size
        return max(0, min(chunk_start_page, len(seq.block_tables[g])) - seq.first_owned_page[g])

    def new_pages(self, seq: Sequence, g: int, num_new: int) -> int:
        return max(0, cdiv(seq.num_computed + num_new, self.block_size)
                   - len(seq.block_tables[g]))


class BlockManager:
    def __init__(self, groups: list[KVGroup], max_rows: int, max_pages: int,
                 prefix_caching: bool = False, hash_algo: str = "builtin"):
        if hash_algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, got "
                             f"{hash_algo!r}")
        self.groups = groups
        self.prefix_caching = prefix_caching
        self.hash_algo = hash_algo
        for grp in groups:
            grp.cache = PageCache(grp.num_blocks) if prefix_caching else None
        #: Prefix cache statistics in tokens, counted at admission (vLLM's
        #: prefix_cache_queries / prefix_cache_hits): tokens looked up, tokens found.
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.tables = [np.zeros((max_rows, max_pages), dtype=np.int32) for _ in groups]
        #: By group and table row: ``len(seq.block_tables[g])`` and ``seq.first_owned_page[g]``
        #: (written with them, here only), so a step reads them without a loop over requests.
        self.num_pages = np.zeros((len(groups), max_rows), dtype=np.int64)
        self.first_owned = np.zeros((len(groups), max_rows), dtype=np.int64)
        self.free_rows = deque(range(max_rows))
        #: Held by the engine loop while it admits (lookup to allocate) or frees, and by
        #: :meth:`reset_prefix_cache` (called from any thread).
        self.lock = threading.RLock()

    def table_rows(self, rows: np.ndarray, g: int, width: int) -> np.ndarray:
        """[len(rows), width] block table of group ``g`` for the requests holding table
        rows ``rows`` (each ``seq.row``; a copy)."""
        return self.tables[g][rows, :width]

    def lookup(self, seq: Sequence) -> Hit | None:
        """The cache hit of a request about to be admitted (None: none, or caching off).
        Requests capturing prompt logits (LLM.prompt_logits) compute every token."""
        if not self.prefix_caching or seq.num_computed or seq.capture is not None:
            return None
        hashes = self._hashes(seq)
        bs = self.groups[0].block_size
        return find_hit(self.groups, hashes, min(len(hashes), (len(seq) - 1) // bs))

    def _hashes(self, seq: Sequence, num_blocks: int = 0) -> list[int]:
        """``seq``'s block hashes: the prompt's (shared by its samples), and to ``num_blocks``
        (generated blocks: a list of its own first)."""
        bs, prompt = self.groups[0].block_size, seq.num_prompt_tokens // self.groups[0].block_size
        if len(seq.block_hashes) < prompt:
            extend_hashes(seq.block_hashes, seq.token_ids, bs, prompt, seq.cache_key,
                          self.hash_algo)
        if num_blocks > len(seq.block_hashes):
            if len(seq.block_hashes) == prompt:  # the samples part after the prompt
                seq.block_hashes = list(seq.block_hashes)
            extend_hashes(seq.block_hashes, seq.token_ids, bs, num_blocks, seq.cache_key,
                          self.hash_algo)
        return seq.block_hashes

    def _gain(self, grp: KVGroup, seq: Sequence, g: int) -> int:
        """Pages the stale release of ``seq`` in group ``g`` makes available."""
        stale = grp.stale_pages(seq, g)
        if grp.cache is None or not stale:
            return stale
        first = seq.first_owned_page[g]
        return grp.cache.gain(seq.block_tables[g][first:first + stale])

    def can_allocate(self, seq: Sequence, num_new: int, hit: Hit | None = None) -> bool:
        """Whether :meth:`allocate` (with the same ``hit``) can give ``seq`` its pages."""
        if hit is not None:  # admission: the hit's revived pages are no longer available
            return all(cdiv(hit.num_tokens + num_new, grp.block_size) - len(hit.tables[g])
                       <= grp.num_free - hit.revived[g] for g, grp in enumerate(self.groups))
        return all(grp.new_pages(seq, g, num_new) <= grp.num_free + self._gain(grp, seq, g)
                   for g, grp in enumerate(self.groups))

    def decode_changes(self, seqs: list[Sequence]) -> np.ndarray | None:
        """For one new token per request (plain decodes), in this order: the positions in
        ``seqs`` whose pages change (new or stale pages in some group), or None when some
        request could not get its pages (the caller then goes request by request, which
        preempts).

        Why all at once is the same as one by one: going in order, request k frees its
        ``stale_k`` pages and takes ``new_k``, so it succeeds exactly when the free count
        ``free_0 + sum_{i<=k} (stale_i - new_i)`` stays >= 0; every prefix sum checked,
        for every group, means every request of the loop would have succeeded.  Requests
        with no change are no-ops of :meth:`allocate` (they hold a row already, so the
        row mirrors ``num_pages`` / ``first_owned`` hold their state).  With prefix caching
        a stale page may be shared (it frees nothing), so stale pages count as no gain: a
        check that is only stricter (a request left out registers its blocks later).
        """
        rows = np.fromiter((s.row for s in seqs), np.int64, len(seqs))
        num_computed = np.fromiter((s.num_computed for s in seqs), np.int64, len(seqs))
        changes = np.zeros(len(seqs), dtype=bool)
        for g, grp in enumerate(self.groups):  # KVGroup.new_pages / stale_pages, vectorised
            owned = self.num_pages[g, rows]
            new = np.maximum(0, -(-(num_computed + 1) // grp.block_size) - owned)
            stale = np.zeros_like(new)
            if grp.chunk_size is not None:
                chunk_page = (num_computed // grp.chunk_size) * grp.chunk_size // grp.block_size
                stale = np.maximum(0, np.minimum(chunk_page, owned) - self.first_owned[g, rows])
            gain = stale if grp.cache is None else 0  # a shared stale page frees nothing
            if (grp.num_free + np.cumsum(gain - new)).min(initial=0) < 0:
                return None
            changes |= (new > 0) | (stale > 0)
        return np.flatnonzero(changes)

    def allocate(self, seq: Sequence, num_new: int, hit: Hit | None = None) -> None:
        """Give ``seq`` pages for positions up to ``num_computed + num_new`` (with ``hit``,
        an admission: ``num_computed`` becomes ``hit.num_tokens`` first).

        Precondition: ``can_allocate(seq, num_new, hit)`` (not re-checked here).
        """
        if seq.row is None:
            seq.row = self.free_rows.popleft()
            if self.prefix_caching:
                self._admit(seq, hit)
            elif seq.num_cached_tokens is None:
                seq.num_cached_tokens = 0
        elif self.prefix_caching:  # blocks computed since (before stale pages go)
            self._register(seq, seq.num_computed)
        for g, grp in enumerate(self.groups):
            table, row = seq.block_tables[g], self.tables[g][seq.row]
            stale = grp.stale_pages(seq, g)
            first = seq.first_owned_page[g]
            if stale:
                grp.release(table[first:first + stale])
                table[first:first + stale] = [0] * stale  # placeholders: never read, see Sequence
                row[first:first + stale] = 0
            seq.first_owned_page[g] = first + stale
            start, count = len(table), grp.new_pages(seq, g, num_new)
            if count:
                table.extend(grp.take(count))
                row[start:start + count] = table[start:]
            self.num_pages[g, seq.row] = len(table)
            self.first_owned[g, seq.row] = seq.first_owned_page[g]
            grp.peak_used = max(grp.peak_used, grp.num_used)
        if self.prefix_caching:
            self._register(seq, seq.num_computed + num_new)

    def _admit(self, seq: Sequence, hit: Hit | None) -> None:
        """Statistics, and the hit's pages shared into ``seq``'s (empty) tables."""
        cached = 0 if hit is None else hit.num_tokens
        self.prefix_cache_queries += len(seq)
        self.prefix_cache_hits += cached
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = cached
        self._hashes(seq)
        if hit is None:
            return
        for g, grp in enumerate(self.groups):
            table, first = list(hit.tables[g]), hit.first[g]
            assert grp.cache is not None
            grp.cache.share(table[first:])
            seq.block_tables[g], seq.first_owned_page[g] = table, first
            self.tables[g][seq.row, :len(table)] = table
        seq.num_computed = hit.num_tokens  # whole blocks
        seq.num_registered = hit.num_tokens // self.groups[0].block_size

    def _register(self, seq: Sequence, end: int) -> None:
        """Register the full blocks of positions ``[0, end)`` whose tokens are known (a
        placeholder of an overlapped step is not) and whose KV is written (or being written
        by this step): prompt and generated blocks alike, as vLLM."""
        bs = self.groups[0].block_size
        known = len(seq.token_ids) if seq.placeholder_index is None else seq.placeholder_index
        num_blocks = min(end, known) // bs
        if num_blocks <= seq.num_registered:
            return
        hashes = self._hashes(seq, num_blocks)
        for g, grp in enumerate(self.groups):
            cache, table = grp.cache, seq.block_tables[g]
            assert cache is not None
            for j in range(max(seq.num_registered, seq.first_owned_page[g]), num_blocks):
                cache.register(table[j], hashes[j])
        seq.num_registered = num_blocks

    def reset_cache(self) -> None:
        """Forget every block hash (call with no page in use: after a failed step)."""
        with self.lock:
            for grp in self.groups:
                if grp.cache is not None:
                    grp.cache.reset(grp.free_blocks)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``: forget every cached block; False, with nothing
        forgotten, while some request holds pages (safe from any thread: a request can
        only get pages again through an admission, which holds ``lock``)."""
        with self.lock:
            if any(grp.num_free != grp.num_blocks for grp in self.groups):
                return False
            self.reset_cache()
            return True

    def free(self, seq: Sequence) -> None:
        with self.lock:
            if self.prefix_caching and seq.row is not None:
                self._register(seq, seq.num_computed)  # its last blocks stay cached too
            self._free(seq)

    def _free(self, seq: Sequence) -> None:
        for g, grp in enumerate(self.groups):
            grp.release(seq.block_tables[g][seq.first_owned_page[g]:])
            seq.block_tables[g] = []
            seq.first_owned_page[g] = 0
            if seq.row is not None:
                self.tables[g][seq.row] = 0
                self.num_pages[g, seq.row] = self.first_owned[g, seq.row] = 0
        seq.num_registered = 0
        if seq.row is not None:
            self.free_rows.append(seq.row)
            seq.row = None
