"""Independent oracles, written from the definitions only (no chunklocal code).

* :func:`dense_chunked_attention`: per request, gather every key of the sequence
  from the paged cache through the *original* block table, build the dense
  per-token mask ``mask[p, k] = k <= p and k // c == p // c`` and run a plain
  float64 softmax.  ``chunk_size=None`` gives plain causal attention.
* :func:`token_split_oracle`: for every query token, by brute force, the chunk it
  falls in, the keys it may see and the pages holding them.  Tests check that the
  virtual batches reproduce exactly this mapping.

Loops over requests and tokens are fine here: clarity over speed.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def _ints(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.cpu().numpy()
    return np.asarray(x).astype(np.int64)


def dense_chunked_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
                            chunk_size=None, scale=None) -> torch.Tensor:
    """Chunked-local (or, with ``chunk_size=None``, causal) attention in float64.

    ``q`` [T, Hq, D]; caches [num_pages, block_size, Hkv, D]; request ``i``'s
    queries are rows ``query_start_loc[i]:query_start_loc[i+1]`` at absolute
    positions ``[s_i - q_i, s_i)``; its key at position ``k`` lives in page
    ``block_table[i, k // block_size]``, slot ``k % block_size``.  Rows outside
    every request stay zero.  Returns float64 on the CPU.
    """
    qsl, seq, table = _ints(query_start_loc), _ints(seq_lens), _ints(block_table)
    q64 = q.detach().cpu().double()
    k64 = k_cache.detach().cpu().double()
    v64 = v_cache.detach().cpu().double()
    num_q_heads, head_dim = q64.shape[1], q64.shape[2]
    block_size, num_kv_heads = k64.shape[1], k64.shape[2]
    group = num_q_heads // num_kv_heads
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    out = torch.zeros(q64.shape, dtype=torch.float64)
    for i in range(len(seq)):
        s, lo, hi = int(seq[i]), int(qsl[i]), int(qsl[i + 1])
        if hi == lo:
            continue
        positions = torch.arange(s)
        pages = torch.from_numpy(table[i, positions.numpy() // block_size])
        slots = positions % block_size
        keys, values = k64[pages, slots], v64[pages, slots]  # [s, Hkv, D]
        q_pos = torch.arange(s - (hi - lo), s)
        mask = positions[None, :] <= q_pos[:, None]
        if chunk_size is not None:
            mask &= (positions[None, :] // chunk_size) == (q_pos[:, None] // chunk_size)
        for h in range(num_q_heads):
            kv = h // group
            scores = (q64[lo:hi, h] @ keys[:, kv].T) * scale
            scores = scores.masked_fill(~mask, float("-inf"))
            out[lo:hi, h] = torch.softmax(scores, dim=-1) @ values[:, kv]
    return out


def token_split_oracle(query_start_loc, seq_lens, block_table, chunk_size, block_size):
    """Per query row, what chunked-local attention needs, by brute force.

    Returns a list with one dict per query row (in row order, padding requests
    contribute none): ``row``, ``request``, ``position``, ``chunk``,
    ``kv_start`` (first key it may see), ``kv_end`` (end of its virtual batch's
    keys: min(chunk end, s)) and ``pages`` (the pages holding a whole chunk from
    ``kv_start`` on, with columns past the table clipped to its last column).
    """
    qsl, seq, table = _ints(query_start_loc), _ints(seq_lens), _ints(block_table)
    width = table.shape[1]
    rows = []
    for i in range(len(seq)):
        s = int(seq[i])
        for j, row in enumerate(range(int(qsl[i]), int(qsl[i + 1]))):
            p = s - (int(qsl[i + 1]) - int(qsl[i])) + j
            visible = [k for k in range(p + 1) if k // chunk_size == p // chunk_size]
            kv_start = visible[0]
            first_page = kv_start // block_size
            pages = [int(table[i, min(first_page + col, width - 1)])
                     for col in range(chunk_size // block_size)]
            rows.append(dict(row=row, request=i, position=p, chunk=p // chunk_size,
                             kv_start=kv_start, kv_end=min(kv_start + chunk_size, s),
                             pages=pages))
    return rows
