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

:func:`split_earlier` (``CHUNKLOCAL_RAGGED_EARLIER``) moves the earlier keys of long
segments (at least ``min_rows`` queries: a long prompt's later chunks) off the paged
kernel too: they are copied from the pages into a contiguous buffer in blocks of at most
``max_keys`` and read by the ragged kernel, non-causal, each block's result merged by
log-sum-exp.  Short segments (decodes, short chunks) keep the paged read, where one pass
over the pages is all the work and a copy would double it.  At most ``max_blocks``
blocks a step (each is one more planned wrapper, with FlashInfer's 8 MiB of plan
buffers on the device and 8 MiB pinned): the long segments give their *last* keys, in
segment order, until ``max_blocks * max_keys`` are taken, and keep the rest as a paged
prefix.  The blocks cut the taken keys, laid end to end, every ``max_keys``: a segment's
keys fall in consecutive blocks, at most one piece in each, so every earlier key of every
row is read exactly once, by the paged part or by one block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from chunklocal.virtual_batches import make_virtual_batches

__all__ = ["EarlierSplit", "KeyBlock", "PagedKV", "PinnedArrays", "RaggedSplit",
           "paged_kv_arrays", "ragged_split", "split_earlier"]


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


@dataclass(frozen=True)
class KeyBlock:
    """One block of gathered earlier keys: ``rows`` [R] int64, the step rows of the segments
    with keys in it (segment order); ``qo_indptr`` [S+1] int32 over ``rows``;
    ``kv_indptr`` [S+1] int32 over the block's keys; ``cache_rows`` [K] int64, each key's
    flat cache row (``page * block_size + offset``)."""

    rows: np.ndarray
    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    cache_rows: np.ndarray


@dataclass(frozen=True)
class EarlierSplit:
    """The earlier keys of one kind's step: the short segments' rows on the paged path
    (``paged_rows`` into the step, ``paged`` their arrays; empty where none) and the long
    segments' keys in gathered ``blocks``."""

    paged_rows: np.ndarray
    paged: PagedKV
    blocks: tuple[KeyBlock, ...]


def split_earlier(split: RaggedSplit, block_size: int, min_rows: int, max_keys: int,
                  max_blocks: int) -> EarlierSplit:
    """``split``'s earlier keys divided between the paged path and at most ``max_blocks``
    gathered blocks of at most ``max_keys`` keys.  Segments of ``min_rows`` queries or more
    (in order, until ``max_blocks * max_keys`` keys are taken) give their last keys to the
    blocks; the rest of their keys (a prefix: whole pages, the last one cut) and every key
    of shorter segments stay paged, so a row may read a paged prefix and gathered keys."""
    if min(min_rows, max_keys, max_blocks) < 1:
        raise ValueError(f"split_earlier: min_rows, max_keys and max_blocks must be "
                         f"positive, got {min_rows}, {max_keys} and {max_blocks}")
    p = split.paged
    n = p.qo_indptr.shape[0] - 1
    q_lens = np.diff(p.qo_indptr).astype(np.int64)
    num_pages = np.diff(p.kv_indptr).astype(np.int64)
    keys = np.where(num_pages > 0, (num_pages - 1) * block_size + p.last_page_len, 0)
    seg_of_row = np.repeat(np.arange(n), q_lens)
    seg_of_page = np.repeat(np.arange(n), num_pages)
    big_keys = np.where(q_lens >= min_rows, keys, 0)
    gathered = np.clip(max_blocks * max_keys - (np.cumsum(big_keys) - big_keys), 0, big_keys)
    kept = keys - gathered  # each segment's paged prefix
    kept_pages = -(-kept // block_size)
    page_in_seg = np.arange(seg_of_page.shape[0]) - p.kv_indptr[:-1][seg_of_page]
    has = kept > 0
    paged = PagedKV(_indptr(q_lens[has]), _indptr(kept_pages[has]),
                    p.kv_indices[page_in_seg < kept_pages[seg_of_page]],
                    (kept - (kept_pages - 1) * block_size)[has].astype(np.int32))
    paged_rows = split.paged_rows[has[seg_of_row]]
    # The gathered keys end to end: key g is key kept[s] + g - key_start[r] of segment
    # s = segs[r].
    taken = gathered > 0
    segs = np.flatnonzero(taken)
    key_start = np.concatenate([[0], np.cumsum(gathered[segs])])
    total = int(key_start[-1])
    if total == 0:
        return EarlierSplit(paged_rows, paged, ())
    owner = np.repeat(np.arange(segs.shape[0]), gathered[segs])  # index into segs
    j = np.arange(total, dtype=np.int64) - key_start[owner] + kept[segs[owner]]
    page = p.kv_indices[p.kv_indptr[segs[owner]] + j // block_size].astype(np.int64)
    cache_rows = page * block_size + j % block_size
    rank_of_seg = np.cumsum(taken) - 1  # a gathered segment's index into segs
    taken_rows = taken[seg_of_row]
    row_rank = rank_of_seg[seg_of_row[taken_rows]]
    rows_taken = split.paged_rows[taken_rows]
    blocks = []
    for lo in range(0, total, max_keys):  # at most max_blocks: total <= their keys
        hi = min(lo + max_keys, total)
        first, last = int(owner[lo]), int(owner[hi - 1])
        touched = np.arange(first, last + 1)
        piece = np.minimum(key_start[touched + 1], hi) - np.maximum(key_start[touched], lo)
        pick = (row_rank >= first) & (row_rank <= last)
        blocks.append(KeyBlock(rows_taken[pick], _indptr(q_lens[segs[touched]]),
                               _indptr(piece), cache_rows[lo:hi]))
    return EarlierSplit(paged_rows, paged, tuple(blocks))


def _indptr(counts) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)


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
