"""Padded slot layouts of CUDA-graph steps (decode and speculative verify): pure math.

A captured step has a fixed batch size B: every request gets the same number of
*slots* (attention problems, see :mod:`.buffers`), one for decode and global
layers, two (first chunk, last chunk) for a chunked verify window that can
straddle a chunk boundary.  These functions lay the slots out; they work on
numpy arrays (host) and torch tensors (device, capturable) alike.  How many
pages each slot may read is sizing: :func:`chunklocal.bounds.sizing.slot_page_limits`.

Two slots cover a window only when it touches at most two chunks, so every
function here raises ValueError when ``query_len > chunk_size`` (a longer window
would silently lose keys).
"""

from __future__ import annotations

import numpy as np
import torch

from chunklocal._validate import check_window


def graph_slots(seq_lens, query_len: int, chunk_size: int | None, block_size: int,
                two_slots: bool):
    """Slots of a padded graph step: (kv_lens, first_page, rows), request-major.

    ``seq_lens`` [B] (numpy or torch; 0 marks a padding request) holds each
    request's length including its ``query_len`` new tokens.  One slot per
    request reads the chunk of its last token (all keys without chunking); with
    ``two_slots`` a first slot reads from the previous chunk's start, and only
    when the window straddles a chunk boundary (a padding slot otherwise).
    Works on numpy arrays (host) and torch tensors (device) alike.
    """
    check_window(query_len, chunk_size)
    xp = torch if isinstance(seq_lens, torch.Tensor) else np
    s = seq_lens
    real = s > 0
    if isinstance(s, torch.Tensor):
        request = torch.arange(s.shape[0], device=s.device, dtype=s.dtype)
    else:
        request = np.arange(s.shape[0], dtype=s.dtype)
    rows = xp.where(real, request, -1)
    if chunk_size is None:
        return s, s * 0, rows
    last_start = xp.where(real, (s - 1) // chunk_size * chunk_size, 0)
    last = (s - last_start, last_start // block_size, rows)
    if not two_slots:
        return last
    straddle = real & (s - query_len < last_start)
    first_start = xp.where(straddle, last_start - chunk_size, 0)
    first = (s - first_start, first_start // block_size, xp.where(straddle, request, -1))
    return tuple(xp.stack([a, b], 1).reshape(-1) for a, b in zip(first, last, strict=True))


def verify_use_first(seq_lens, query_len: int, chunk_size: int) -> torch.Tensor | np.ndarray:
    """[B, query_len] bool: query row i of request r lies before its last chunk's start."""
    check_window(query_len, chunk_size)
    xp = torch if isinstance(seq_lens, torch.Tensor) else np
    s = seq_lens
    if isinstance(s, torch.Tensor):
        offsets = torch.arange(query_len, device=s.device, dtype=s.dtype)
    else:
        offsets = np.arange(query_len, dtype=s.dtype)
    last_start = xp.where(s > 0, (s - 1) // chunk_size * chunk_size, 0)
    position = (s - query_len)[:, None] + offsets[None, :]
    return (position < last_start[:, None]) & (s > 0)[:, None]
