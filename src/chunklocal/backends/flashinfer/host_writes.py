"""Host write paths of the metadata buffers: numpy into the pinned mirrors.

:class:`HostWrites` is the host half of :class:`.buffers.MetadataBuffers`: it owns
the two pinned mirror sets and their caches (:meth:`HostWrites._allocate_mirrors`);
from the subclass it reads only ``name``, ``block_size`` and ``ensure_capacity``.
:meth:`HostWrites.write_host` is the general path for any slots;
:meth:`HostWrites.write_decode_chunked` (pure decode of chunked layers) and
:meth:`HostWrites.write_whole_requests` (global layers reading whole requests)
are fast paths that fill the same arrays with fewer numpy calls
and hand any input they do not cover to the general path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from chunklocal._validate import INT32_MAX, cdiv, raise_first
from chunklocal.backends.flashinfer.graph_layout import graph_slots


class _DecodeCache:
    """Index arrays that only grow, reused across steps instead of re-made each step."""

    def __init__(self):
        self._positions = np.zeros(0, np.intp)
        self._row_starts = np.zeros(0, np.int64)
        self._key = (-1, 0)

    def positions(self, size: int) -> np.ndarray:
        """``arange(size)`` as intp (a view of a cached array)."""
        if size > self._positions.shape[0]:
            self._positions = np.arange(max(size, 2 * self._positions.shape[0]), dtype=np.intp)
        return self._positions[:size]

    def row_starts(self, rows: int, width: int, plus: int = 0) -> np.ndarray:
        """``arange(rows) * width + plus``: flat offset of each block-table row, shifted."""
        if (width, plus) != self._key or rows > self._row_starts.shape[0]:
            self._row_starts = np.arange(max(rows, self._row_starts.shape[0]),
                                         dtype=np.int64) * width + plus
            self._key = (width, plus)
        return self._row_starts[:rows]


@dataclass(frozen=True)
class HostStep:
    """What write_host filled: views of the pinned mirrors (valid until the next write)."""

    num_batches: int
    num_pages: int
    qo_indptr: torch.Tensor
    paged_kv_indptr: torch.Tensor
    paged_kv_last_page_len: torch.Tensor
    paged_kv_indices: torch.Tensor
    mirror_set: int


class HostWrites:
    """Host writes of :class:`.buffers.MetadataBuffers` (see module doc)."""

    # Provided by the subclass (MetadataBuffers): all that the writes read of it.
    name: str
    block_size: int

    def ensure_capacity(self, num_batches: int, num_pages: int = 0) -> None:
        """Make room for a step of ``num_batches`` slots and ``num_pages`` pages."""
        raise NotImplementedError

    def _allocate_mirrors(self, lengths: dict[str, int], pin: bool) -> None:
        """Two pinned mirror sets of int32 buffers of ``lengths`` entries, and their caches.

        Two sets: a step's non-blocking copies may still be queued when the next
        step is written, so writes alternate and wait on the older copy.
        """
        self.host = [{n: torch.zeros(size, dtype=torch.int32, pin_memory=pin)
                      for n, size in lengths.items()} for _ in range(2)]
        # numpy views of the mirrors, made once (t.numpy() per call is not free).
        self._host_np = [{n: t.numpy() for n, t in mirrors.items()} for mirrors in self.host]
        self._room = (lengths["paged_kv_indptr"] - 1, lengths["paged_kv_indices"])
        self._decode_cache = _DecodeCache()
        self._view_cache: dict = {}
        # Per mirror set: qo_indptr[:k] is known to hold 0..k-1 (a decode wrote it).
        self._qo_counting = [0, 0]
        self._next_set = 0
        self._copy_done: list[torch.cuda.Event | None] = [None, None]

    def write_host(self, query_lens, kv_lens, first_page, rows, block_table,
                   scratch_page: int = 0) -> HostStep:
        """Fill a mirror set for slots as described in :mod:`.buffers` (numpy, vectorised)."""
        q = np.asarray(query_lens, dtype=np.int64)
        kv = np.asarray(kv_lens, dtype=np.int64)
        num_batches = q.shape[0]
        rows = np.asarray(rows, dtype=np.int64)
        padding = rows < 0
        kv = np.where(padding, 1, kv)
        raise_first(kv <= 0, lambda m: f"{self.name}: slot {m} reads {int(kv[m])} keys; "
                    "every slot needs at least one key")
        pages = cdiv(kv, self.block_size)
        table = np.asarray(block_table)
        if table.ndim != 2:
            raise ValueError(f"{self.name}: block_table must be 2-D, got shape {table.shape}")
        first = np.asarray(first_page, dtype=np.int64)
        raise_first(~padding & (first < 0),
                    lambda m: f"{self.name}: slot {m} starts at block-table column "
                    f"{int(np.broadcast_to(first, kv.shape)[m])}; first_page must be >= 0")
        end = first + pages
        raise_first(~padding & (end > table.shape[1]),
                    lambda m: f"{self.name}: slot {m} reads pages up to column "
                    f"{int(end[m]) - 1} of a {table.shape[1]}-column block table")
        raise_first(~padding & (rows >= table.shape[0]),
                    lambda m: f"{self.name}: slot {m} reads block-table row {int(rows[m])} "
                    f"of a {table.shape[0]}-row table")
        ends = np.cumsum(pages)
        num_pages = int(ends[-1]) if num_batches else 0
        flat = gathered = None
        if table.size:
            # Flat index of every page: one repeat and one add, then one gather.  The
            # index is intp: np.take casts any other index dtype to it first.
            base = np.where(padding, 0, rows * table.shape[1] + first)
            flat = np.repeat(base - (ends - pages), pages).astype(np.intp, copy=False)
            flat += self._decode_cache.positions(num_pages)
            if table.dtype != np.int32:
                # Not gathered straight into the int32 mirror: a wider id would wrap.
                gathered = np.take(table.reshape(-1), flat)
                if table.dtype.itemsize > 4 or table.dtype == np.uint32:
                    self._check_int32_pages(gathered, padding, pages, ends, rows, first)
        # Bad input is refused above, before any buffer grows or any mirror is claimed.
        self.ensure_capacity(num_batches)
        self.ensure_capacity(num_batches, num_pages)
        mirror_set = self._claim_mirror_set()
        host = self._host_np[mirror_set]
        kv_indptr = host["paged_kv_indptr"]
        kv_indptr[0] = 0
        kv_indptr[1:num_batches + 1] = ends
        host["qo_indptr"][0] = 0
        np.cumsum(q, out=host["qo_indptr"][1:num_batches + 1])
        self._qo_counting[mirror_set] = 0
        host["paged_kv_last_page_len"][:num_batches] = kv - (pages - 1) * self.block_size
        indices = host["paged_kv_indices"][:num_pages]
        if gathered is not None:
            indices[:] = gathered
        elif flat is not None:
            np.take(table.reshape(-1), flat, out=indices)
        if padding.any() or not table.size:
            indices[np.repeat(padding | (not table.size), pages)] = scratch_page
        mirrors = self.host[mirror_set]
        return HostStep(num_batches, num_pages, mirrors["qo_indptr"][:num_batches + 1],
                        mirrors["paged_kv_indptr"][:num_batches + 1],
                        mirrors["paged_kv_last_page_len"][:num_batches],
                        mirrors["paged_kv_indices"][:num_pages], mirror_set)

    def _check_int32_pages(self, gathered, padding, pages, ends, rows, first) -> None:
        """Page ids reach the int32 mirror: refuse one a real slot reads that would wrap."""
        # Two reductions (no temporaries) clear the usual table; the mask only on failure.
        if not gathered.size or (gathered.max() <= INT32_MAX
                                 and gathered.min() >= -INT32_MAX - 1):
            return
        wraps = (gathered > INT32_MAX) | (gathered < -INT32_MAX - 1)
        if padding.any():
            wraps &= ~np.repeat(padding, pages)

        def message(p):
            m = int(np.searchsorted(ends, p, side="right"))
            row = int(np.broadcast_to(rows, ends.shape)[m])
            col = int(np.broadcast_to(first, ends.shape)[m]) + p - int(ends[m] - pages[m])
            return (f"{self.name}: slot {m} reads block_table[{row}, {col}] = "
                    f"{int(gathered[p])}, which does not fit an int32 page id")

        raise_first(wraps, message)

    def write_decode_chunked(self, seq_lens, block_table, chunk_size: int,
                             scratch_page: int = 0) -> HostStep:
        """Pure-decode step of chunked layers: one slot per request, its last chunk's pages.

        Fills the same arrays as :meth:`write_host` on ``graph_slots(seq_lens, 1,
        chunk_size, block_size, False)`` (a request with ``seq_len <= 0`` is a padding
        slot) in about a dozen numpy calls: per-request arithmetic once in int64,
        results written straight into the mirrors, aranges and row offsets reused
        across steps.  Inputs this path does not cover go to the general one,
        which also raises its errors.
        """
        s = np.asarray(seq_lens)
        table = np.asarray(block_table)
        bs = self.block_size
        n = s.shape[0] if s.ndim == 1 else 0
        if (not n or s.dtype.kind != "i" or table.ndim != 2 or not table.size
                or table.shape[0] < n or chunk_size % bs or int(s.max()) > table.shape[1] * bs):
            kv, first, rows = graph_slots(s, 1, chunk_size, bs, False)
            return self.write_host(np.ones(kv.shape[0], np.int64), kv, first, rows, table,
                                   scratch_page)
        # Request r's last key is at page p_r = (s_r - 1) // bs, offset o_r in it; its
        # chunk holds pages_r = p_r % (chunk_size // bs) + 1 pages ending at p_r, with
        # p_r < cdiv(s_r, bs) <= width (checked above): every flat index below is in
        # range, so the gather skips numpy's bounds check (mode="wrap").
        # max(s - 1, 0) turns a padding request into one key at page 0.
        last_key = np.subtract(s, 1, dtype=np.int64)
        padded = int(last_key.min()) < 0
        if padded:
            np.maximum(last_key, 0, out=last_key)
        last_page, last_offset = np.divmod(last_key, bs)
        pages = np.remainder(last_page, chunk_size // bs)
        pages += 1
        if n > self._room[0] or n * (chunk_size // bs) > self._room[1]:
            self.ensure_capacity(n, int(pages.sum()))
        mirror_set = self._claim_mirror_set()
        host = self._host_np[mirror_set]
        cache = self._decode_cache
        kv_indptr = host["paged_kv_indptr"]
        kv_indptr[0] = 0
        # add.accumulate with dtype: cheaper than np.cumsum casting into the mirror.
        np.add.accumulate(pages, dtype=np.int32, out=kv_indptr[1:n + 1])
        num_pages = int(kv_indptr[n])
        np.add(last_offset, 1, out=host["paged_kv_last_page_len"][:n])
        if self._qo_counting[mirror_set] < n + 1:
            host["qo_indptr"][:n + 1] = cache.positions(n + 1)
            self._qo_counting[mirror_set] = n + 1
        # Flat index of page j of request r: r * width + p_r - pages_r + 1 + j, built
        # as repeat(r * width + p_r + 1 - kv_indptr[r + 1]) + (position in the output).
        base = last_page
        base += cache.row_starts(n, table.shape[1], plus=1)
        base -= kv_indptr[1:n + 1]
        flat = np.repeat(base, pages)
        flat += cache.positions(num_pages)
        indices = host["paged_kv_indices"][:num_pages]
        if table.dtype == np.int32:
            np.take(table.reshape(-1), flat, out=indices, mode="wrap")
        else:
            indices[:] = np.take(table.reshape(-1), flat, mode="wrap")
        if padded:
            indices[kv_indptr[:n][s <= 0]] = scratch_page
        qo, kv, last = self._fixed_views(mirror_set, n)
        return HostStep(n, num_pages, qo, kv, last,
                        self.host[mirror_set]["paged_kv_indices"][:num_pages], mirror_set)

    def write_whole_requests(self, query_lens, seq_lens, block_table) -> HostStep:
        """Global layers, every table row a request with queries: slot r reads all of row r.

        Same arrays as ``write_host(query_lens, seq_lens, 0, arange(n), block_table)``.
        When the requests fill at least a third of the table, one boolean-mask
        gather (pages come out row-major, the kv_indices order) beats building a
        flat index (BENCHMARKS.md, "Numbers behind code comments"); sparser tables,
        and inputs this path does not cover, take the general path.
        """
        q = np.asarray(query_lens, dtype=np.int64)
        kv = np.asarray(seq_lens, dtype=np.int64)
        table = np.asarray(block_table)
        bs = self.block_size
        n = kv.shape[0] if kv.ndim == 1 else 0
        if (not n or table.ndim != 2 or table.shape[0] != n or not table.size
                or q.shape != kv.shape or int(kv.min()) <= 0
                or int(kv.max()) > table.shape[1] * bs):
            return self.write_host(q, kv, np.zeros(n, np.int64), np.arange(n), table)
        pages = kv + (bs - 1)
        pages //= bs
        num_pages = int(pages.sum())
        if table.size > 3 * num_pages:
            return self.write_host(q, kv, np.zeros(n, np.int64), np.arange(n), table)
        self.ensure_capacity(n, num_pages)
        mirror_set = self._claim_mirror_set()
        host = self._host_np[mirror_set]
        host["paged_kv_indptr"][0] = 0
        np.add.accumulate(pages, dtype=np.int32, out=host["paged_kv_indptr"][1:n + 1])
        host["qo_indptr"][0] = 0
        np.add.accumulate(q, dtype=np.int32, out=host["qo_indptr"][1:n + 1])
        self._qo_counting[mirror_set] = 0
        last_page_len = host["paged_kv_last_page_len"][:n]
        np.subtract(kv, (pages - 1) * bs, out=last_page_len)
        keep = self._decode_cache.positions(table.shape[1]) < pages[:, None]
        host["paged_kv_indices"][:num_pages] = table[keep]
        qo, kv_indptr, last = self._fixed_views(mirror_set, n)
        return HostStep(n, num_pages, qo, kv_indptr, last,
                        self.host[mirror_set]["paged_kv_indices"][:num_pages], mirror_set)

    def _fixed_views(self, mirror_set: int, n: int):
        """Torch views of the first ``n`` slots' mirrors, cached (slicing is not free)."""
        key = (mirror_set, n)
        views = self._view_cache.get(key)
        if views is None:
            mirrors = self.host[mirror_set]
            views = (mirrors["qo_indptr"][:n + 1], mirrors["paged_kv_indptr"][:n + 1],
                     mirrors["paged_kv_last_page_len"][:n])
            if len(self._view_cache) > 64:
                self._view_cache.clear()
            self._view_cache[key] = views
        return views

    def _claim_mirror_set(self) -> int:
        mirror_set = self._next_set
        self._next_set ^= 1
        event = self._copy_done[mirror_set]
        if event is not None:
            event.synchronize()
        return mirror_set
