"""Persistent paged-KV metadata buffers, sized once from proven bounds.

One :class:`MetadataBuffers` holds the int32 arrays a FlashInfer-style kernel reads
for one attention kind (the chunked or the global layers of a KV group):
``qo_indptr``, ``paged_kv_indptr``, ``paged_kv_last_page_len``, ``paged_kv_indices``
and, for speculative verify under CUDA graphs, ``verify_use_first`` (which of a
window's two virtual batches each query row reads; see backends/flashinfer.py).
Each lives on the device with a pinned host mirror (plain CPU tensors on CPU-only
machines).  They are allocated once: CUDA-graph decode wrappers alias slices of
them, so they are never rebound while graphs are on.

A step is described by *slots* (attention problems): ``kv_lens[m]`` keys read from
``block_table[rows[m]]`` starting at column ``first_page[m]``; ``rows[m] == -1``
marks a padding slot, which reads one key of the reserved scratch page and no real
KV.  The host path (:meth:`MetadataBuffers.write_host`) fills the mirrors with numpy
(``np.cumsum(..., out=mirror_slice)``); :meth:`MetadataBuffers.copy_to_device` then
makes one non-blocking copy per buffer.  The device path
(:meth:`MetadataBuffers.write_device`) computes the same arrays with torch ops of
fixed shape straight into the device buffers: no host sync, so it can be captured
in a CUDA graph.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from chunklocal import bounds
from chunklocal._validate import cdiv

logger = logging.getLogger(__name__)

BUFFER_NAMES = ("qo_indptr", "paged_kv_indptr", "paged_kv_last_page_len", "paged_kv_indices")


class CapacityError(ValueError):
    """A step needs more room than a buffer that may not be reallocated."""

    def __init__(self, buffer: str, bound: int, observed: int):
        self.buffer, self.bound, self.observed = buffer, int(bound), int(observed)
        super().__init__(
            f"{buffer} holds {self.bound} entries (its bound) but this step needs "
            f"{self.observed}; buffers aliased by CUDA graphs cannot grow"
        )


@dataclass(frozen=True)
class Capacity:
    """Slots (indptr has ``batches + 1`` entries) and page indices a buffer set holds."""

    batches: int
    pages: int

    def union(self, other: Capacity) -> Capacity:
        return Capacity(max(self.batches, other.batches), max(self.pages, other.pages))


def _global_pages(n_max: int, tokens: int, model_len: int, block_size: int) -> int:
    exact = getattr(bounds, "max_global_pages", None)
    if exact is not None:
        return int(exact(n_max, tokens, model_len, block_size))
    return min(n_max, tokens) * cdiv(model_len, block_size)


def step_capacity(spec, limits, *, chunked: bool) -> Capacity:
    """Most slots and pages one eager step can need, for the chunked or global layers.

    ``chunked=True`` sizes the virtual batches of the spec's chunk size
    (:func:`chunklocal.bounds.max_virtual_batches`, ``max_local_pages``);
    ``chunked=False`` sizes whole requests (global layers: a plain full spec, or the
    global layers of a merged group, which keep room for whole sequences).
    """
    from chunklocal.kv_spec import chunk_size_of

    n_max, tokens = limits.max_num_seqs, limits.max_num_batched_tokens
    model_len, block_size = limits.max_model_len, spec.block_size
    if not chunked:
        return Capacity(min(n_max, tokens), _global_pages(n_max, tokens, model_len, block_size))
    chunk = chunk_size_of(spec)
    if chunk is None:
        raise ValueError(f"chunked=True needs a spec with a chunk size, got {spec!r}")
    return Capacity(
        int(bounds.max_virtual_batches(n_max, tokens, chunk, model_len)),
        int(bounds.max_local_pages(n_max, tokens, chunk, model_len, block_size)),
    )


def slot_page_limits(chunk: int | None, query_len: int, model_len: int,
                     block_size: int) -> tuple[int, ...]:
    """Most pages each slot of one request's padded graph layout can read.

    Decode (``query_len == 1``) and global layers use one slot per request; a
    chunked verify window uses two (first chunk, last chunk) when a chunk
    boundary can fall inside it.  The first slot reads from the previous chunk's
    start through the window's end: at most ``c + query_len - 1`` keys.
    """
    seq_pages = cdiv(model_len, block_size)
    if chunk is None:
        return (seq_pages,)
    last = min(cdiv(chunk, block_size), seq_pages)
    if query_len == 1 or model_len <= chunk:
        return (last,)
    return (min(cdiv(chunk + query_len - 1, block_size), seq_pages), last)


def graph_capacity(batch_sizes, chunk: int | None, query_len: int, model_len: int,
                   block_size: int) -> Capacity:
    """Slots and pages of the padded layouts of every captured batch size."""
    per_slot = slot_page_limits(chunk, query_len, model_len, block_size)
    biggest = max(batch_sizes, default=0)
    return Capacity(biggest * len(per_slot), biggest * sum(per_slot))


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


class MetadataBuffers:
    """Persistent int32 metadata buffers for one attention kind of one KV group."""

    def __init__(self, capacity: Capacity, block_size: int, *, device="cpu",
                 cuda_graphs: bool = False, name: str = "metadata", verify_rows: int = 0):
        if capacity.batches < 0 or capacity.pages < 0:
            raise ValueError(f"{name}: capacity must be non-negative, got {capacity}")
        self.name = name
        self.block_size = int(block_size)
        self.device = torch.device(device)
        self.cuda_graphs = bool(cuda_graphs)
        self._pin = self.device.type == "cuda"
        self._warned = False
        self.capacity = capacity
        self.gpu: dict[str, torch.Tensor] = {}
        self.verify_use_first = torch.zeros(verify_rows, dtype=torch.bool, device=self.device)
        self._allocate(capacity)
        # Two mirror sets: a step's non-blocking copies may still be queued when
        # the next step is written, so writes alternate and wait on the older copy.
        self._next_set = 0
        self._copy_done: list[torch.cuda.Event | None] = [None, None]

    def _sizes(self, capacity: Capacity) -> dict[str, int]:
        return {"qo_indptr": capacity.batches + 1, "paged_kv_indptr": capacity.batches + 1,
                "paged_kv_last_page_len": capacity.batches,
                "paged_kv_indices": max(capacity.pages, 1)}

    def _allocate(self, capacity: Capacity) -> None:
        sizes = self._sizes(capacity)
        self.gpu = {n: torch.zeros(sizes[n], dtype=torch.int32, device=self.device)
                    for n in BUFFER_NAMES}
        self.host = [{n: torch.zeros(sizes[n], dtype=torch.int32, pin_memory=self._pin)
                      for n in BUFFER_NAMES} for _ in range(2)]
        # numpy views of the mirrors, made once: t.numpy() costs ~1 us per call.
        self._host_np = [{n: t.numpy() for n, t in mirrors.items()} for mirrors in self.host]
        self._room = (sizes["paged_kv_indptr"] - 1, sizes["paged_kv_indices"])
        self.capacity = capacity
        self._decode_cache = _DecodeCache()
        self._view_cache: dict = {}
        # Per mirror set: qo_indptr[:k] is known to hold 0..k-1 (a decode wrote it).
        self._qo_counting = [0, 0]

    def ensure_capacity(self, num_batches: int, num_pages: int = 0) -> None:
        """Make room for a step, or raise CapacityError if buffers are frozen (graphs on)."""
        need = {"paged_kv_indptr": num_batches + 1, "paged_kv_indices": num_pages}
        have = self._sizes(self.capacity)
        short = [n for n in need if need[n] > have[n]]
        if not short:
            return
        if self.cuda_graphs:
            n = short[0]
            raise CapacityError(f"{self.name}.{n}", have[n], need[n])
        grown = Capacity(max(self.capacity.batches, num_batches),
                         max(self.capacity.pages, num_pages))
        if not self._warned:
            logger.warning("%s: a step needs %d batches / %d pages, more than the bound "
                           "(%d / %d); growing the buffers (CUDA graphs are off)", self.name,
                           num_batches, num_pages, self.capacity.batches, self.capacity.pages)
            self._warned = True
        self._allocate(grown)

    # ------------------------------------------------------------------ host
    def write_host(self, query_lens, kv_lens, first_page, rows, block_table,
                   scratch_page: int = 0) -> HostStep:
        """Fill a mirror set for slots described as in the module doc (numpy, vectorised)."""
        q = np.asarray(query_lens, dtype=np.int64)
        kv = np.asarray(kv_lens, dtype=np.int64)
        num_batches = q.shape[0]
        self.ensure_capacity(num_batches)
        rows = np.asarray(rows, dtype=np.int64)
        padding = rows < 0
        kv = np.where(padding, 1, kv)
        bad = np.flatnonzero(kv <= 0)
        if bad.size:
            m = int(bad[0])
            raise ValueError(f"{self.name}: slot {m} reads {int(kv[m])} keys; every slot "
                             "needs at least one key")
        pages = cdiv(kv, self.block_size)
        num_pages = int(pages.sum())
        self.ensure_capacity(num_batches, num_pages)
        mirror_set = self._claim_mirror_set()
        host = self._host_np[mirror_set]
        kv_indptr = host["paged_kv_indptr"]
        kv_indptr[0] = 0
        np.cumsum(pages, out=kv_indptr[1:num_batches + 1])
        host["qo_indptr"][0] = 0
        np.cumsum(q, out=host["qo_indptr"][1:num_batches + 1])
        self._qo_counting[mirror_set] = 0
        host["paged_kv_last_page_len"][:num_batches] = kv - (pages - 1) * self.block_size
        indices = host["paged_kv_indices"][:num_pages]
        table = np.asarray(block_table)
        if table.size:
            end = np.asarray(first_page, dtype=np.int64) + pages
            bad = np.flatnonzero(~padding & (end > table.shape[1]))
            if bad.size:
                m = int(bad[0])
                raise ValueError(f"{self.name}: slot {m} reads pages up to column "
                                 f"{int(end[m]) - 1} of a {table.shape[1]}-column block table")
            # Flat index of every page: one repeat and one add, then one gather.  The
            # index is intp: np.take casts any other index dtype to it first (an
            # int32 index made the gather ~2x slower).
            base = np.where(padding, 0, rows * table.shape[1]
                            + np.asarray(first_page, dtype=np.int64))
            flat = np.repeat(base - kv_indptr[:num_batches], pages).astype(np.intp, copy=False)
            flat += self._decode_cache.positions(num_pages)
            if table.dtype == np.int32:
                np.take(table.reshape(-1), flat, out=indices)
            else:
                indices[:] = np.take(table.reshape(-1), flat)
        if padding.any() or not table.size:
            indices[np.repeat(padding | (not table.size), pages)] = scratch_page
        mirrors = self.host[mirror_set]
        return HostStep(num_batches, num_pages, mirrors["qo_indptr"][:num_batches + 1],
                        mirrors["paged_kv_indptr"][:num_batches + 1],
                        mirrors["paged_kv_last_page_len"][:num_batches],
                        mirrors["paged_kv_indices"][:num_pages], mirror_set)

    def write_decode_chunked(self, seq_lens, block_table, chunk: int,
                             scratch_page: int = 0) -> HostStep:
        """Pure-decode step of chunked layers: one slot per request, its last chunk's pages.

        Fills the same arrays as :meth:`write_host` on ``graph_slots(seq_lens, 1,
        chunk, block_size, False)`` (a request with ``seq_len <= 0`` is a padding
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
                or table.shape[0] < n or chunk % bs or int(s.max()) > table.shape[1] * bs):
            kv, first, rows = graph_slots(s, 1, chunk, bs, False)
            return self.write_host(np.ones(kv.shape[0], np.int64), kv, first, rows, table,
                                   scratch_page)
        # Request r's last key is at page p_r = (s_r - 1) // bs, offset o_r in it; its
        # chunk holds pages_r = p_r % (chunk // bs) + 1 pages ending at p_r, with
        # p_r < cdiv(s_r, bs) <= width (checked above): every flat index below is in
        # range, so the gather skips numpy's bounds check (mode="wrap").
        # max(s - 1, 0) turns a padding request into one key at page 0.
        last_key = np.subtract(s, 1, dtype=np.int64)
        padded = int(last_key.min()) < 0
        if padded:
            np.maximum(last_key, 0, out=last_key)
        last_page, last_offset = np.divmod(last_key, bs)
        pages = np.remainder(last_page, chunk // bs)
        pages += 1
        if n > self._room[0] or n * (chunk // bs) > self._room[1]:
            self.ensure_capacity(n, int(pages.sum()))
        mirror_set = self._claim_mirror_set()
        host = self._host_np[mirror_set]
        cache = self._decode_cache
        kv_indptr = host["paged_kv_indptr"]
        kv_indptr[0] = 0
        # add.accumulate with dtype: half the cost of np.cumsum casting into the mirror.
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
        flat index (measured: 1.3 vs 1.9 ms for 1.06M pages of a [256, 8192]
        table); sparser tables, and inputs this path does not cover, take the
        general path.
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
        """Torch views of the first ``n`` slots' mirrors, cached (slicing costs ~3 us)."""
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

    def mark_consumed(self, step: HostStep) -> None:
        """Record that every copy reading ``step``'s mirrors has been queued."""
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._copy_done[step.mirror_set] = event

    def copy_to_device(self, step: HostStep) -> None:
        """One non-blocking copy per buffer, mirror slice -> persistent device slice."""
        for name in BUFFER_NAMES:
            src = getattr(step, name)
            self.gpu[name][: src.shape[0]].copy_(src, non_blocking=True)
        self.mark_consumed(step)

    # ---------------------------------------------------------------- device
    def write_device(self, kv_lens: torch.Tensor, first_page: torch.Tensor,
                     rows: torch.Tensor, block_table: torch.Tensor, num_pages_reserved: int,
                     scratch_page: int = 0) -> None:
        """Fill paged_kv_indptr/last_page_len/indices for ``len(kv_lens)`` slots on device.

        Fixed shapes only (``num_pages_reserved`` index entries are written, those
        past the last real page point at the scratch page), no ``.item()``: safe to
        capture in a CUDA graph.  ``torch.cumsum(out=...)`` writes straight into a
        slice of the persistent indptr buffer.
        """
        num_slots = kv_lens.shape[0]
        if num_slots + 1 > self.gpu["paged_kv_indptr"].shape[0]:
            raise CapacityError(f"{self.name}.paged_kv_indptr",
                                self.gpu["paged_kv_indptr"].shape[0], num_slots + 1)
        if num_pages_reserved > self.gpu["paged_kv_indices"].shape[0]:
            raise CapacityError(f"{self.name}.paged_kv_indices",
                                self.gpu["paged_kv_indices"].shape[0], num_pages_reserved)
        padding = rows < 0
        kv = torch.where(padding, torch.ones_like(kv_lens), kv_lens).clamp_(min=1)
        pages = (kv + self.block_size - 1) // self.block_size
        indptr = self.gpu["paged_kv_indptr"]
        indptr[:1].zero_()
        torch.cumsum(pages, 0, dtype=torch.int32, out=indptr[1:num_slots + 1])
        self.gpu["paged_kv_last_page_len"][:num_slots].copy_(kv - (pages - 1) * self.block_size)
        entry = torch.arange(num_pages_reserved, device=kv.device, dtype=torch.int32)
        slot = torch.searchsorted(indptr[1:num_slots + 1], entry, right=True)
        slot.clamp_(max=num_slots - 1)
        column = first_page[slot] + entry - indptr[slot]
        column.clamp_(min=0, max=max(block_table.shape[1] - 1, 0))
        row = rows.clamp(min=0)[slot]
        real = (entry < indptr[num_slots]) & ~padding[slot]
        value = block_table[row.long(), column.long()].to(torch.int32)
        self.gpu["paged_kv_indices"][:num_pages_reserved].copy_(
            torch.where(real, value, torch.full_like(value, scratch_page)))


# ------------------------------------------------------------- graph layouts
def graph_slots(seq_lens, query_len: int, chunk: int | None, block_size: int,
                two_slots: bool):
    """Slots of a padded graph step: (kv_lens, first_page, rows), request-major.

    ``seq_lens`` [B] (numpy or torch; 0 marks a padding request) holds each
    request's length including its ``query_len`` new tokens.  One slot per
    request reads the chunk of its last token (all keys without chunking); with
    ``two_slots`` a first slot reads from the previous chunk's start, and only
    when the window straddles a chunk boundary (a padding slot otherwise).
    Works on numpy arrays (host) and torch tensors (device) alike.
    """
    xp = torch if isinstance(seq_lens, torch.Tensor) else np
    s = seq_lens
    real = s > 0
    if isinstance(s, torch.Tensor):
        request = torch.arange(s.shape[0], device=s.device, dtype=s.dtype)
    else:
        request = np.arange(s.shape[0], dtype=s.dtype)
    rows = xp.where(real, request, -1)
    if chunk is None:
        return s, s * 0, rows
    last_start = xp.where(real, (s - 1) // chunk * chunk, 0)
    last = (s - last_start, last_start // block_size, rows)
    if not two_slots:
        return last
    straddle = real & (s - query_len < last_start)
    first_start = xp.where(straddle, last_start - chunk, 0)
    first = (s - first_start, first_start // block_size, xp.where(straddle, request, -1))
    return tuple(xp.stack([a, b], 1).reshape(-1) for a, b in zip(first, last, strict=True))


def verify_use_first(seq_lens, query_len: int, chunk: int) -> torch.Tensor | np.ndarray:
    """[B, query_len] bool: query row i of request r lies before its last chunk's start."""
    xp = torch if isinstance(seq_lens, torch.Tensor) else np
    s = seq_lens
    if isinstance(s, torch.Tensor):
        offsets = torch.arange(query_len, device=s.device, dtype=s.dtype)
    else:
        offsets = np.arange(query_len, dtype=s.dtype)
    last_start = xp.where(s > 0, (s - 1) // chunk * chunk, 0)
    position = (s - query_len)[:, None] + offsets[None, :]
    return (position < last_start[:, None]) & (s > 0)[:, None]


# ------------------------------------------------------------- whole steps
def attention_kinds(spec) -> tuple[bool, ...]:
    """Which layer kinds read this spec: (True,) chunked, (False,) global, or both (merged)."""
    from chunklocal.kv_spec import chunk_size_of, needs_global_pages

    chunked = (True,) if chunk_size_of(spec) else ()
    return chunked + ((False,) if needs_global_pages(spec) else ())


def group_capacities(spec, limits, graph_batch_sizes=(), query_lens=(1,)) -> dict:
    """Capacity per layer kind: the step bound, widened for padded graph layouts."""
    from chunklocal.kv_spec import chunk_size_of

    out = {}
    for chunked in attention_kinds(spec):
        capacity = step_capacity(spec, limits, chunked=chunked)
        chunk = chunk_size_of(spec) if chunked else None
        for query_len in query_lens:
            capacity = capacity.union(graph_capacity(graph_batch_sizes, chunk, query_len,
                                                     limits.max_model_len, spec.block_size))
        out[chunked] = capacity
    return out


def write_step(buffers: MetadataBuffers, qsl, seq, table, query_lens,
               chunk: int | None) -> HostStep:
    """Eager step: virtual batches (chunked) or requests with queries (global) -> mirrors."""
    from chunklocal.virtual_batches import make_virtual_batches

    query_lens = np.asarray(query_lens)
    if chunk and query_lens.size and (query_lens == 1).all():
        # Pure decode: one virtual batch per request, read straight from the
        # request's own table (no [M, c / bs] local table to gather).
        return buffers.write_decode_chunked(seq, table, chunk)
    if chunk:
        vb = make_virtual_batches(qsl, seq, table, chunk, buffers.block_size)
        buffers.ensure_capacity(vb.num_batches)
        return buffers.write_host(vb.query_lens, vb.seq_lens, np.zeros(vb.num_batches, np.int64),
                                  np.arange(vb.num_batches), vb.block_table)
    rows = np.flatnonzero(query_lens > 0)
    if (rows.size and rows.size == np.shape(table)[0] == query_lens.size
            and np.shape(seq) == query_lens.shape):
        return buffers.write_whole_requests(query_lens, seq, table)
    buffers.ensure_capacity(rows.size)
    return buffers.write_host(query_lens[rows], np.asarray(seq)[rows],
                              np.zeros(rows.size, np.int64), rows, table)


def write_graph_step(buffers: MetadataBuffers, seq_lens, block_table, query_len: int,
                     chunk: int | None, two_slots: bool, scratch_page: int):
    """Padded graph step on the host: fills mirrors; returns (HostStep, use_first or None)."""
    kv, first, rows = graph_slots(seq_lens, query_len, chunk, buffers.block_size, two_slots)
    step = buffers.write_host(np.full(kv.shape[0], query_len), kv, first, rows, block_table,
                              scratch_page)
    mask = verify_use_first(seq_lens, query_len, chunk).reshape(-1) if two_slots else None
    return step, mask


def write_graph_step_device(buffers: MetadataBuffers, seq_lens: torch.Tensor,
                            block_table: torch.Tensor, query_len: int, chunk: int | None,
                            two_slots: bool, scratch_page: int, model_len: int) -> None:
    """Padded graph step on the device (capturable); also fills verify_use_first."""
    limits = slot_page_limits(chunk, query_len, model_len, buffers.block_size)
    kv, first, rows = graph_slots(seq_lens, query_len, chunk, buffers.block_size, two_slots)
    buffers.write_device(kv, first, rows, block_table, seq_lens.shape[0] * sum(limits),
                         scratch_page)
    if two_slots:
        mask = verify_use_first(seq_lens, query_len, chunk).reshape(-1)
        buffers.verify_use_first[: mask.shape[0]].copy_(mask)
