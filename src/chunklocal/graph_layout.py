"""Padded slot layouts of CUDA-graph steps (decode and speculative verify).

A captured step has a fixed batch size B: every request gets the same number of
*slots* (attention problems, see :mod:`chunklocal.metadata`), one for decode and
global layers, two (first chunk, last chunk) for a chunked verify window that can
straddle a chunk boundary.  These functions lay the slots out and write them into
:class:`~chunklocal.metadata.MetadataBuffers`, on the host or (capturable) on the
device.  They work on numpy arrays and torch tensors alike.

Two slots cover a window only when it touches at most two chunks, so every
function here that takes ``query_len`` and a chunk size raises ValueError when
``query_len > chunk`` (a longer window would silently lose keys).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from chunklocal._validate import cdiv

if TYPE_CHECKING:
    from chunklocal.metadata import MetadataBuffers


def _check_window(query_len: int, chunk: int | None) -> None:
    """The two-slot layout holds a window of query_len tokens only if query_len <= chunk."""
    if chunk is not None and query_len > chunk:
        raise ValueError(f"query_len {query_len} exceeds the chunk size {chunk}: a graph step's "
                         "window must fit in one chunk so that it touches at most two chunks")


def slot_page_limits(chunk: int | None, query_len: int, model_len: int,
                     block_size: int) -> tuple[int, ...]:
    """Most pages each slot of one request's padded graph layout can read.

    Decode (``query_len == 1``) and global layers use one slot per request; a
    chunked verify window uses two (first chunk, last chunk) when a chunk
    boundary can fall inside it.  The first slot reads from the previous chunk's
    start through the window's end: at most ``c + query_len - 1`` keys.
    """
    _check_window(query_len, chunk)
    seq_pages = cdiv(model_len, block_size)
    if chunk is None:
        return (seq_pages,)
    last = min(cdiv(chunk, block_size), seq_pages)
    if query_len == 1 or model_len <= chunk:
        return (last,)
    return (min(cdiv(chunk + query_len - 1, block_size), seq_pages), last)


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
    _check_window(query_len, chunk)
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
    _check_window(query_len, chunk)
    xp = torch if isinstance(seq_lens, torch.Tensor) else np
    s = seq_lens
    if isinstance(s, torch.Tensor):
        offsets = torch.arange(query_len, device=s.device, dtype=s.dtype)
    else:
        offsets = np.arange(query_len, dtype=s.dtype)
    last_start = xp.where(s > 0, (s - 1) // chunk * chunk, 0)
    position = (s - query_len)[:, None] + offsets[None, :]
    return (position < last_start[:, None]) & (s > 0)[:, None]


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
