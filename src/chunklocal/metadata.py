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

This module holds the buffers, their sizing (:class:`Capacity`, :class:`CapacityError`)
and the device path.  The host write paths live in :mod:`chunklocal.metadata_host`
and the padded CUDA-graph slot layouts in :mod:`chunklocal.graph_layout`; their
public names are re-exported here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from chunklocal import bounds
from chunklocal.graph_layout import (
    graph_slots,
    slot_page_limits,
    verify_use_first,
    write_graph_step,
    write_graph_step_device,
)
from chunklocal.kv_spec import attention_kinds, chunk_size_of
from chunklocal.metadata_host import HostStep, HostWrites, _DecodeCache

__all__ = [
    "BUFFER_NAMES", "Capacity", "CapacityError", "HostStep", "MetadataBuffers",
    "attention_kinds", "graph_capacity", "graph_slots", "group_capacities",
    "slot_page_limits", "step_capacity", "verify_use_first", "write_graph_step",
    "write_graph_step_device", "write_step",
]

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


def step_capacity(spec, limits, *, chunked: bool) -> Capacity:
    """Most slots and pages one eager step can need, for the chunked or global layers.

    ``chunked=True`` sizes the virtual batches of the spec's chunk size
    (:func:`chunklocal.bounds.max_virtual_batches`, ``max_local_pages``);
    ``chunked=False`` sizes whole requests (global layers: a plain full spec, or the
    global layers of a merged group, which keep room for whole sequences).
    """
    n_max, tokens = limits.max_num_seqs, limits.max_num_batched_tokens
    model_len, block_size = limits.max_model_len, spec.block_size
    if not chunked:
        return Capacity(min(n_max, tokens),
                        bounds.max_global_pages(n_max, tokens, model_len, block_size))
    chunk = chunk_size_of(spec)
    if chunk is None:
        raise ValueError(f"chunked=True needs a spec with a chunk size, got {spec!r}")
    return Capacity(
        int(bounds.max_virtual_batches(n_max, tokens, chunk, model_len)),
        int(bounds.max_local_pages(n_max, tokens, chunk, model_len, block_size)),
    )


def graph_capacity(batch_sizes, chunk: int | None, query_len: int, model_len: int,
                   block_size: int) -> Capacity:
    """Slots and pages of the padded layouts of every captured batch size."""
    per_slot = slot_page_limits(chunk, query_len, model_len, block_size)
    biggest = max(batch_sizes, default=0)
    return Capacity(biggest * len(per_slot), biggest * sum(per_slot))


class MetadataBuffers(HostWrites):
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


# ------------------------------------------------------------- whole steps
def group_capacities(spec, limits, graph_batch_sizes=(), query_lens=(1,)) -> dict:
    """Capacity per layer kind: the step bound, widened for padded graph layouts."""
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
    """Eager step: virtual batches (chunked) or requests with queries (global) -> mirrors.

    The batch must already have passed :func:`chunklocal.virtual_batches.validate_batch`
    (the backends call it first); the pure-decode fast path does not re-check it.
    """
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
