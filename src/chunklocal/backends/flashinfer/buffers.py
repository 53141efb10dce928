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
makes one non-blocking copy per buffer.

This module holds the buffers and the padded CUDA-graph steps
(:meth:`MetadataBuffers.write_graph_step`).  Their sizes
come from :mod:`chunklocal.bounds.sizing`, the host write paths from
:mod:`.host_writes`, the slot layouts from :mod:`.graph_layout`.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from chunklocal._validate import as_bool
from chunklocal.backends.flashinfer.graph_layout import graph_slots, verify_use_first
from chunklocal.backends.flashinfer.host_writes import HostStep, HostWrites
from chunklocal.bounds.sizing import Capacity
from chunklocal.virtual_batches import split_batch

__all__ = ["BUFFER_NAMES", "CapacityError", "HostStep", "MetadataBuffers", "write_step"]

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


class MetadataBuffers(HostWrites):
    """Persistent int32 metadata buffers for one attention kind of one KV group."""

    def __init__(self, capacity: Capacity, block_size: int, *, device="cpu",
                 cuda_graphs: bool = False, name: str = "metadata", verify_rows: int = 0):
        if capacity.batches < 0 or capacity.pages < 0:
            raise ValueError(f"{name}: capacity must be non-negative, got {capacity}")
        self.name = name
        self.block_size = int(block_size)
        self.device = torch.device(device)
        self.cuda_graphs = as_bool(cuda_graphs, "cuda_graphs")
        self._warned = False
        self.verify_use_first = torch.zeros(verify_rows, dtype=torch.bool, device=self.device)
        self._allocate(capacity)

    def _allocate(self, capacity: Capacity) -> None:
        lengths = capacity.buffer_lengths()
        self.gpu = {n: torch.zeros(lengths[n], dtype=torch.int32, device=self.device)
                    for n in BUFFER_NAMES}
        self._allocate_mirrors(lengths, pin=self.device.type == "cuda")
        self.capacity = capacity

    def ensure_capacity(self, num_batches: int, num_pages: int = 0) -> None:
        """Make room for a step, or raise CapacityError if buffers are frozen (graphs on)."""
        need = {"paged_kv_indptr": num_batches + 1, "paged_kv_indices": num_pages}
        have = self.capacity.buffer_lengths()
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

    # ----------------------------------------------------------- graph steps
    def write_graph_step(self, seq_lens, block_table, query_len: int, chunk_size: int | None,
                         two_slots: bool, scratch_page: int):
        """Padded graph step on the host: fills mirrors; returns (HostStep, use_first or None)."""
        kv, first, rows = graph_slots(seq_lens, query_len, chunk_size, self.block_size,
                                      two_slots)
        step = self.write_host(np.full(kv.shape[0], query_len), kv, first, rows, block_table,
                               scratch_page)
        mask = None
        if two_slots:
            mask = verify_use_first(seq_lens, query_len, chunk_size).reshape(-1)
        return step, mask


# ------------------------------------------------------------- whole steps
def write_step(buffers: MetadataBuffers, query_start_loc, seq_lens, block_table, query_lens,
               chunk_size: int | None) -> HostStep:
    """Eager step: virtual batches (chunked) or requests with queries (global) -> mirrors.

    The batch must already have passed :func:`chunklocal.virtual_batches.validate_batch`
    (the backend's ``build()`` calls it once); nothing here re-checks it.
    """
    query_lens = np.asarray(query_lens)
    if chunk_size and query_lens.size and (query_lens == 1).all():
        # Pure decode: one virtual batch per request, read straight from the
        # request's own table (no [M, c / bs] local table to gather).
        return buffers.write_decode_chunked(seq_lens, block_table, chunk_size)
    if chunk_size:
        vb = split_batch(query_start_loc, seq_lens, block_table, query_lens, chunk_size,
                         buffers.block_size)
        buffers.ensure_capacity(vb.num_batches)
        return buffers.write_host(vb.query_lens, vb.seq_lens, np.zeros(vb.num_batches, np.int64),
                                  np.arange(vb.num_batches), vb.block_table)
    rows = np.flatnonzero(query_lens > 0)
    if (rows.size and rows.size == np.shape(block_table)[0] == query_lens.size
            and np.shape(seq_lens) == query_lens.shape):
        return buffers.write_whole_requests(query_lens, seq_lens, block_table)
    buffers.ensure_capacity(rows.size)
    return buffers.write_host(query_lens[rows], np.asarray(seq_lens)[rows],
                              np.zeros(rows.size, np.int64), rows, block_table)
