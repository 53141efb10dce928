"""The step's own keys apart from the earlier ones (``CHUNKLOCAL_RAGGED_OWN_KEYS``).

A prefill or mixed step reads two kinds of keys in each of its segments (a chunked
layer's virtual batch: one chunk's slice of a request's queries, rows ``[a, b)`` with
keys ``[chunk_start, b)``; a global layer's request): the keys ``[a, b)`` the step has
just computed, and the earlier keys ``[chunk_start, a)`` already in the paged cache.

* Own keys: causal and square (``kv_indptr == qo_indptr``), read straight from the
  step's contiguous K/V by FlashInfer's ragged prefill kernel, which on sm_90 is FA3's
  TMA-fed kernel (exact under memcheck where the paged FA3 kernel is not;
  docs/fa3-analysis.md).
* Earlier keys: every row of the segment sees all of them (non-causal), through the
  paged cache, planned only for the segments that have any.
* The two partial results merged by their log-sum-exp on those rows.

Every row sees exactly its chunk's keys up to itself either way: own keys ``[a, row]``
(causal) and earlier keys ``[chunk_start, a)``, disjoint, together ``[chunk_start, row]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from chunklocal.virtual_batches import make_virtual_batches

__all__ = ["PagedKV", "PinnedArrays", "RaggedSplit", "paged_kv_arrays", "ragged_split"]


@dataclass(frozen=True)
class PagedKV:
    """FlashInfer's four paged-KV arrays for one step (int32 numpy)."""

    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    last_page_len: np.ndarray

    @property
    def num_problems(self) -> int:
        return int(self.kv_indptr.shape[0] - 1)


def paged_kv_arrays(query_start_loc, seq_lens, block_table, block_size: int) -> PagedKV:
    """Page indices of the first ``cdiv(seq_len, block_size)`` columns of each row."""
    seq = np.asarray(seq_lens, dtype=np.int64)
    table = np.asarray(block_table)
    pages = -(-seq // block_size)
    kv_indptr = np.zeros(seq.shape[0] + 1, dtype=np.int32)
    np.cumsum(pages, out=kv_indptr[1:])
    # Flat positions of the pages in the row-major table: row * W + column.
    row_start = np.arange(seq.shape[0], dtype=np.int64) * table.shape[1]
    first_flat = np.repeat(row_start - kv_indptr[:-1], pages)
    flat = first_flat + np.arange(int(kv_indptr[-1]), dtype=np.int64)
    kv_indices = table.reshape(-1)[flat].astype(np.int32, copy=False)
    last = (seq - (pages - 1) * block_size).astype(np.int32)
    return PagedKV(np.asarray(query_start_loc, dtype=np.int32), kv_indptr, kv_indices, last)


@dataclass(frozen=True)
class RaggedSplit:
    """Host arrays of the split (int32 unless said).

    ``qo_indptr`` [M+1]: the segments' rows, also the own keys' indptr;
    ``paged_rows`` [R] int64: rows that also see earlier keys, in row order;
    ``paged``: the paged arrays for those rows (qo_indptr into ``paged_rows``,
    non-causal keys ``[chunk_start, a)``).
    """

    qo_indptr: np.ndarray
    paged_rows: np.ndarray
    paged: PagedKV
    num_batches: int


def ragged_split(query_start_loc, seq_lens, block_table, chunk_size: int | None,
                 block_size: int) -> RaggedSplit:
    """The split of one step for one layer kind: virtual batches where ``chunk_size`` (a
    chunked layer), else one segment a request (a global layer).  ``query_start_loc[0]``
    must be 0 (the segments' rows index the step's K/V)."""
    if chunk_size:
        vb = make_virtual_batches(query_start_loc, seq_lens, block_table, chunk_size,
                                  block_size)
        qsl, seq, table = vb.query_start_loc, vb.seq_lens, vb.block_table
    else:
        qsl, seq, table = (np.asarray(a) for a in (query_start_loc, seq_lens, block_table))
    if qsl.size and qsl[0] != 0:
        raise ValueError(f"the split needs query_start_loc[0] == 0, got {int(qsl[0])}")
    q_lens = np.diff(qsl).astype(np.int64)
    earlier = seq.astype(np.int64) - q_lens  # keys cached before this step
    has = earlier > 0
    starts, lens = qsl[:-1][has].astype(np.int64), q_lens[has]
    rows = np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens) \
        + np.arange(int(lens.sum()), dtype=np.int64)
    paged_qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    paged = paged_kv_arrays(paged_qsl, earlier[has], table[has], block_size)
    return RaggedSplit(qsl.astype(np.int32), rows, paged, int(q_lens.shape[0]))


class PinnedArrays:
    """Host staging of one eager step's ragged-path arrays, page-locked on a CUDA machine: a
    copy to the device from pageable memory may wait for the stream, which would stall the
    overlapped steps (engine/overlap.py).  Each array has its buffer, grown by doubling;
    the backend keeps one set per eager parity, as it keeps two wrappers, since the next
    step is planned while the last one's copies may still be queued."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._buffers: dict[str, torch.Tensor] = {}

    def put(self, name: str, array: np.ndarray) -> torch.Tensor:
        """``array`` (int32 or int64) copied into buffer ``name``: a view of its length."""
        array = np.ascontiguousarray(array)
        dtype = torch.from_numpy(array[:0]).dtype
        buf = self._buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < array.size:
            size = max(array.size, 2 * (buf.numel() if buf is not None else 32))
            buf = self._buffers[name] = torch.empty(size, dtype=dtype, pin_memory=self.pin)
        view = buf[:array.size]
        view.numpy()[:] = array
        return view
