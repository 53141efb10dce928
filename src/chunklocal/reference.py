"""PyTorch reference attention over a paged KV cache (also the engine's CPU backend).

Chunked-local attention is computed the way a kernel without a chunk mask would
do it: split the batch into virtual batches, then run plain causal attention on
them.  The causal part is vectorised over rows: query rows are cut into tiles of
at most ``_TILE_ROWS`` rows, each tile gathers only the keys its last row can see
(so a long prefill costs about half its full square), tiles are sorted by key
count and processed in groups whose padded work fits a fixed element budget.
The loop is over groups (bounded by memory), never over requests.

Precision: float32 and float64 inputs are computed in their own dtype; float16
and bfloat16 are computed in float32 and the result is cast back to ``q.dtype``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from chunklocal._validate import as_int_array, cdiv
from chunklocal.virtual_batches import make_virtual_batches, validate_batch

_TILE_ROWS = 128
# Elements one group may use: scores, gathered K and V, gathered queries and outputs
# (1 << 25 float32 elements = 128 MiB), padded to the group's largest tile.
_GROUP_BUDGET = 1 << 25


def _check_tensors(q, k_cache, v_cache) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, num_q_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4:
        raise ValueError("k_cache must be [num_pages, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache shape "
                         f"{tuple(k_cache.shape)}")
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q head_dim {q.shape[2]} differs from the cache's {k_cache.shape[3]}")
    if k_cache.shape[2] == 0 or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"num_q_heads {q.shape[1]} is not a multiple of num_kv_heads "
                         f"{k_cache.shape[2]}")
    if not (q.is_floating_point() and k_cache.is_floating_point()
            and v_cache.is_floating_point()):
        raise ValueError("q, k_cache and v_cache must be floating point")
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError(f"q, k_cache, v_cache on different devices: "
                         f"{q.device}, {k_cache.device}, {v_cache.device}")


def _check_rows_and_pages(q, k_cache, qsl, seq, table, offset) -> None:
    """Every query row and page a row reads must exist (ValueError, not IndexError later)."""
    num_pages, block_size = k_cache.shape[:2]
    if qsl.size and qsl[-1] > q.shape[0]:
        raise ValueError(f"query_start_loc ends at {int(qsl[-1])} but q has {q.shape[0]} rows")
    pages_needed = cdiv(offset + seq, block_size) * (seq > 0)
    bad = np.flatnonzero(pages_needed > table.shape[1])
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"request {i}: kv_start offset {int(offset[i])} + seq_len "
                         f"{int(seq[i])} needs {int(pages_needed[i])} pages but block_table "
                         f"has only {table.shape[1]} columns")
    used = np.arange(table.shape[1])[None, :] < pages_needed[:, None]
    bad_page = used & ((table < 0) | (table >= num_pages))
    if bad_page.any():
        i, col = (int(x) for x in np.argwhere(bad_page)[0])
        raise ValueError(f"request {i}: block_table[{i}, {col}] = {int(table[i, col])} is not "
                         f"a page of the cache (0..{num_pages - 1})")


def _tiles(qsl, seq, query_lens):
    """Cut each row's queries into tiles; return per-tile row start, rows, keys seen."""
    per_row = cdiv(query_lens, _TILE_ROWS)
    row_of_tile = np.repeat(np.arange(seq.shape[0]), per_row)
    first_tile = np.cumsum(per_row) - per_row
    index_in_row = np.arange(row_of_tile.shape[0]) - first_tile[row_of_tile]
    local_start = index_in_row * _TILE_ROWS
    rows = np.minimum(query_lens[row_of_tile] - local_start, _TILE_ROWS)
    # Bottom-right alignment: the tile's last query sees keys up to this count.
    keys = seq[row_of_tile] - query_lens[row_of_tile] + local_start + rows
    return row_of_tile, qsl[row_of_tile] + local_start, rows, keys


def _groups(rows, keys, num_q_heads: int, num_kv_heads: int, head_dim: int):
    """Split tiles (sorted by key count) into consecutive groups within the budget.

    A group's elements: scores (rows x keys x Hq), gathered K and V (keys x Hkv x D
    each), gathered queries and outputs (rows x Hq x D each), all padded to the
    group's largest tile.  The cost only grows with the group, so one
    searchsorted finds where each group ends.
    """
    start, n = 0, rows.shape[0]
    while start < n:
        padded_rows = np.maximum.accumulate(rows[start:])
        count = np.arange(1, n - start + 1)
        cost = count * (keys[start:] * (padded_rows * num_q_heads + 2 * num_kv_heads * head_dim)
                        + padded_rows * 2 * num_q_heads * head_dim)
        stop = start + max(1, int(np.searchsorted(cost, _GROUP_BUDGET, side="right")))
        yield start, stop
        start = stop


def paged_causal_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, *,
                           kv_start=None, scale=None) -> torch.Tensor:
    """Causal (bottom-right aligned) attention over a paged NHD cache.

    Row ``m`` has queries ``q[query_start_loc[m]:query_start_loc[m+1]]`` and keys
    at positions ``[kv_start[m], kv_start[m] + seq_lens[m])``, stored from column 0
    of ``block_table[m]`` on (position ``kv_start[m]`` sits at slot
    ``kv_start[m] % block_size`` of that first page).  ``kv_start`` defaults to 0
    (the whole request); a virtual batch's local table works directly.  Query
    ``j`` of a row of ``q_m`` queries sees its first ``seq_lens[m] - q_m + j + 1``
    keys.  GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``.

    ``q`` [T, Hq, D]; caches [num_pages, block_size, Hkv, D] on any one device;
    index arrays are host data (numpy, CPU torch tensors or lists, any int
    dtype), checked and converted once, then copied to ``q.device`` per group
    without syncs.  Returns [T, Hq, D] in ``q.dtype``; rows outside
    ``[query_start_loc[0], query_start_loc[-1])`` are zero.
    """
    _check_tensors(q, k_cache, v_cache)
    num_pages, block_size, num_kv_heads, head_dim = k_cache.shape
    qsl, seq, table, query_lens = validate_batch(query_start_loc, seq_lens, block_table,
                                                 block_size)
    offset = np.zeros_like(seq)
    if kv_start is not None:
        start = as_int_array(kv_start, "kv_start", ndim=1)
        if start.shape != seq.shape:
            raise ValueError(f"kv_start has {start.shape[0]} entries, seq_lens {seq.shape[0]}")
        bad = np.flatnonzero(start < 0)
        if bad.size:
            raise ValueError(f"request {int(bad[0])}: kv_start {int(start[bad[0]])} is negative")
        offset = start % block_size
    _check_rows_and_pages(q, k_cache, qsl, seq, table, offset)

    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    row_of_tile, row_start, rows, keys = _tiles(qsl, seq, query_lens)
    order = np.argsort(keys, kind="stable")
    row_of_tile, row_start, rows, keys = (a[order] for a in (row_of_tile, row_start, rows, keys))

    device = q.device
    as_dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    table_dev = as_dev(table.astype(np.int64, copy=False))
    for lo, hi in _groups(rows, keys, q.shape[1], num_kv_heads, head_dim):
        q_pad, k_pad = int(rows[lo:hi].max()), int(keys[hi - 1])
        j = np.arange(q_pad)
        valid = j[None, :] < rows[lo:hi, None]                      # [g, q_pad]
        q_rows = np.where(valid, row_start[lo:hi, None] + j, 0)
        # Query j of a tile sees keys < limit; padded rows see key 0 only (discarded).
        limit = np.where(valid, keys[lo:hi, None] - rows[lo:hi, None] + j + 1, 1)
        key_index = np.arange(k_pad)
        # Padding keys read column 0 (always a real page): unused table entries may be junk.
        key_pos = np.where(key_index < keys[lo:hi, None],
                           offset[row_of_tile[lo:hi], None] + key_index, 0)
        columns = key_pos // block_size
        pages = table_dev[as_dev(row_of_tile[lo:hi])[:, None], as_dev(columns)]
        slots = as_dev(key_pos % block_size)
        k = k_cache[pages, slots].to(compute).permute(0, 2, 1, 3)  # [g, Hkv, k_pad, D]
        v = v_cache[pages, slots].to(compute).permute(0, 2, 1, 3)
        qg = q[as_dev(q_rows)].to(compute).permute(0, 2, 1, 3)     # [g, Hq, q_pad, D]
        mask = as_dev(key_index[None, None, :] < limit[:, :, None])[:, None]
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=num_kv_heads != q.shape[1])
        # Integer (not boolean) indexing: no device sync on a GPU.
        kept = np.flatnonzero(valid.ravel())
        o = o.permute(0, 2, 1, 3).reshape(-1, q.shape[1], head_dim)[as_dev(kept)]
        out[as_dev(q_rows.ravel()[kept])] = o.to(q.dtype)
    return out


def reference_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, *,
                        chunk_size=None, scale=None) -> torch.Tensor:
    """Causal attention, or chunked-local attention when ``chunk_size`` is given.

    Arguments as :func:`paged_causal_attention` with ``block_table`` the requests'
    own tables (position ``k`` in page ``block_table[i, k // block_size]``).  With
    ``chunk_size`` the query at position ``p`` sees keys ``k <= p`` with
    ``k // chunk_size == p // chunk_size``: the batch is cut into virtual batches
    (:func:`chunklocal.make_virtual_batches`) and each runs plain causal attention.
    """
    _check_tensors(q, k_cache, v_cache)
    if chunk_size is None:
        return paged_causal_attention(q, k_cache, v_cache, query_start_loc, seq_lens,
                                      block_table, scale=scale)
    # Check against the caller's own table first, so errors name the caller's requests.
    qsl, seq, table, _ = validate_batch(query_start_loc, seq_lens, block_table,
                                        k_cache.shape[1])
    _check_rows_and_pages(q, k_cache, qsl, seq, table, np.zeros_like(seq))
    vb = make_virtual_batches(qsl, seq, table, chunk_size, k_cache.shape[1])
    return paged_causal_attention(q, k_cache, v_cache, vb.query_start_loc, vb.seq_lens,
                                  vb.block_table, kv_start=vb.kv_start, scale=scale)
