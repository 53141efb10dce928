"""PyTorch reference attention over a paged KV cache (also the engine's CPU backend).

Chunked-local attention is computed the way a kernel without a chunk mask would
do it: split the batch into virtual batches, then run plain causal attention on
them.  The causal part is vectorised over rows: query rows are cut into tiles of
at most ``_TILE_ROWS`` rows, each tile gathers only the keys its last row can see
(so a long prefill costs about half its full square), tiles are sorted by key
count and processed in groups whose padded work fits a fixed element budget.

FlashInfer's split: :func:`plan_paged_attention` does the host work once per step
(validation, tiling, grouping, gather indices and masks, copied to the device
once); :func:`run_paged_attention` is tensor math only and runs once per layer.
Its loop is over the planned groups (bounded by memory), never over requests.

Precision: float32 and float64 inputs are computed in their own dtype; float16
and bfloat16 are computed in float32 and the result is cast back to ``q.dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from chunklocal._validate import as_int, as_int_array, cdiv, raise_first
from chunklocal.kv_spec import softmax_scale
from chunklocal.virtual_batches import make_virtual_batches, validate_batch

_TILE_ROWS = 128
# Elements one group may use: scores, gathered K and V, gathered queries and outputs
# (1 << 25 float32 elements = 128 MiB), padded to the group's largest tile.
_GROUP_BUDGET = 1 << 25
# Boolean mask elements a plan keeps ready (16 MiB).  Past that a group keeps one
# key limit per query row and run() compares on the fly: a long prefill's masks
# together are about half its square (650 MB for 36000 tokens), too much to hold.
_PLAN_MASK_BUDGET = 1 << 24


@dataclass(frozen=True, eq=False)
class TileGroup:
    """Device tensors of one group of tiles (g tiles, padded to q_pad rows, k_pad keys)."""

    q_rows: torch.Tensor           # [g, q_pad] rows of q (padding rows read row 0)
    key_slots: torch.Tensor        # [g, k_pad] page * block_size + slot (padding: a real slot)
    mask: torch.Tensor | None      # [g, 1, q_pad, k_pad] bool, or None: use key_limit
    key_limit: torch.Tensor | None  # [g, 1, q_pad, 1]: row j sees keys < key_limit
    key_index: torch.Tensor | None  # [k_pad]
    kept: torch.Tensor | None      # real rows among the g * q_pad computed (None: all)
    out_rows: torch.Tensor         # where the kept rows go in the output


@dataclass(frozen=True, eq=False)
class PagedAttentionPlan:
    """One step's causal attention problems, ready for any number of layers."""

    groups: tuple[TileGroup, ...]
    block_size: int
    num_kv_heads: int
    head_dim: int
    num_q_heads: int | None        # None: any multiple of num_kv_heads
    rows_end: int                  # q must have at least this many rows
    pages_end: int                 # the cache must have at least this many pages
    device: torch.device
    seq_lens: np.ndarray           # keys of each planned row (host copy, for statistics)


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


def _check_pages(seq, table, offset, block_size: int, num_pages: int | None) -> int:
    """Every page a row reads must exist; return 1 + the largest page read."""
    pages_needed = cdiv(offset + seq, block_size) * (seq > 0)
    bad = np.flatnonzero(pages_needed > table.shape[1])
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"request {i}: kv_start offset {int(offset[i])} + seq_len "
                         f"{int(seq[i])} needs {int(pages_needed[i])} pages but block_table "
                         f"has only {table.shape[1]} columns")
    used = np.arange(table.shape[1])[None, :] < pages_needed[:, None]
    limit = np.iinfo(np.int64).max if num_pages is None else num_pages
    bad_page = used & ((table < 0) | (table >= limit))
    if bad_page.any():
        i, col = (int(x) for x in np.argwhere(bad_page)[0])
        pages = "" if num_pages is None else f" (0..{num_pages - 1})"
        raise ValueError(f"request {i}: block_table[{i}, {col}] = {int(table[i, col])} is not "
                         f"a page of the cache{pages}")
    return int(np.where(used, table, -1).max(initial=-1)) + 1


def _check_rows(rows_end: int, q) -> None:
    if rows_end > q.shape[0]:
        raise ValueError(f"query_start_loc ends at {rows_end} but q has {q.shape[0]} rows")


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


def plan_paged_attention(query_start_loc, seq_lens, block_table, *, block_size: int,
                         num_kv_heads: int, head_dim: int, num_q_heads: int | None = None,
                         kv_start=None, num_pages: int | None = None,
                         device="cpu") -> PagedAttentionPlan:
    """Host work of :func:`paged_causal_attention`, once per step (see it for the rows).

    Index arrays are host data (numpy, CPU torch tensors or lists, any int dtype).
    The geometry sizes the groups (``num_q_heads=None`` budgets as if Hq == Hkv)
    and is checked again by :func:`run_paged_attention`.  With ``num_pages`` every
    page read is checked against the cache here, naming the request; without it
    :func:`run_paged_attention` checks the largest page read against the cache.
    Raises ValueError naming the request and value.
    """
    block_size, num_kv_heads, head_dim = (as_int(x, name) for x, name in (
        (block_size, "block_size"), (num_kv_heads, "num_kv_heads"), (head_dim, "head_dim")))
    if num_kv_heads <= 0 or head_dim <= 0:
        raise ValueError(f"num_kv_heads {num_kv_heads} and head_dim {head_dim} must be positive")
    if num_q_heads is not None and (as_int(num_q_heads, "num_q_heads") <= 0
                                    or num_q_heads % num_kv_heads):
        raise ValueError(f"num_q_heads {num_q_heads} is not a positive multiple of "
                         f"num_kv_heads {num_kv_heads}")
    if num_pages is not None and as_int(num_pages, "num_pages") < 0:
        raise ValueError(f"num_pages must be non-negative, got {num_pages}")
    qsl, seq, table, query_lens = validate_batch(query_start_loc, seq_lens, block_table,
                                                 block_size)
    if kv_start is not None:
        kv_start = as_int_array(kv_start, "kv_start", ndim=1)
        if kv_start.shape != seq.shape:
            raise ValueError(f"kv_start has {kv_start.shape[0]} entries, seq_lens "
                             f"{seq.shape[0]}")
        raise_first(kv_start < 0, lambda i: f"request {i}: kv_start {int(kv_start[i])} is "
                    "negative")
    return plan_validated(qsl, seq, table, query_lens, block_size=block_size,
                          num_kv_heads=num_kv_heads, head_dim=head_dim, num_q_heads=num_q_heads,
                          kv_start=kv_start, num_pages=num_pages, device=device)


def plan_validated(query_start_loc, seq_lens, block_table, query_lens, *, block_size: int,
                   num_kv_heads: int, head_dim: int, num_q_heads: int | None = None,
                   kv_start=None, num_pages: int | None = None,
                   device="cpu") -> PagedAttentionPlan:
    """:func:`plan_paged_attention` on a batch ``validate_batch`` already checked (numpy)."""
    qsl = np.asarray(query_start_loc, dtype=np.int64)
    seq = np.asarray(seq_lens, dtype=np.int64)
    table, query_lens = block_table, np.asarray(query_lens, dtype=np.int64)
    offset = np.zeros_like(seq) if kv_start is None else np.asarray(kv_start) % block_size
    pages_end = _check_pages(seq, table, offset, block_size, num_pages)

    device = _concrete_device(device)
    as_dev = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    row_of_tile, row_start, rows, keys = _tiles(qsl, seq, query_lens)
    order = np.argsort(keys, kind="stable")
    row_of_tile, row_start, rows, keys = (a[order] for a in (row_of_tile, row_start, rows, keys))
    groups, mask_elements = [], 0
    budget_heads = num_kv_heads if num_q_heads is None else num_q_heads
    for lo, hi in _groups(rows, keys, budget_heads, num_kv_heads, head_dim):
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
        pages = table[row_of_tile[lo:hi, None], key_pos // block_size].astype(np.int64)
        mask_elements += (hi - lo) * q_pad * k_pad
        keep_mask = mask_elements <= _PLAN_MASK_BUDGET
        kept = np.flatnonzero(valid.ravel())
        groups.append(TileGroup(
            q_rows=as_dev(q_rows),
            key_slots=as_dev(pages * block_size + key_pos % block_size),
            mask=as_dev(key_index < limit[:, :, None])[:, None] if keep_mask else None,
            key_limit=None if keep_mask else as_dev(limit)[:, None, :, None],
            key_index=None if keep_mask else as_dev(key_index),
            kept=None if kept.size == valid.size else as_dev(kept),
            out_rows=as_dev(q_rows.ravel()[kept])))
    return PagedAttentionPlan(tuple(groups), block_size, num_kv_heads, head_dim, num_q_heads,
                              int(qsl[-1]) if qsl.size else 0, pages_end, device, seq)


def _concrete_device(device) -> torch.device:
    """``"cuda"`` means the current CUDA device: name its index, as tensors on it do,
    so that the plan's device compares equal to ``q.device``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_against_plan(plan: PagedAttentionPlan, q, k_cache) -> None:
    """Shapes only (a few int comparisons): no data is read, nothing syncs."""
    geometry = (k_cache.shape[1], k_cache.shape[2], k_cache.shape[3])
    planned = (plan.block_size, plan.num_kv_heads, plan.head_dim)
    if geometry != planned:
        raise ValueError(f"cache (block_size, num_kv_heads, head_dim) {geometry} differs from "
                         f"the plan's {planned}")
    if plan.num_q_heads is not None and q.shape[1] != plan.num_q_heads:
        raise ValueError(f"q has {q.shape[1]} heads, the plan was made for {plan.num_q_heads}")
    if q.device != plan.device:
        raise ValueError(f"q is on {q.device}, the plan's tensors on {plan.device}")
    _check_rows(plan.rows_end, q)
    if plan.pages_end > k_cache.shape[0]:
        raise ValueError(f"the plan reads page {plan.pages_end - 1} but the cache has "
                         f"{k_cache.shape[0]} pages")


def _gather(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows[index]`` for a 2-D index; index_select is several times faster on the CPU."""
    return rows.index_select(0, index.reshape(-1)).view(*index.shape, *rows.shape[1:])


def run_paged_attention(plan: PagedAttentionPlan, q, k_cache, v_cache,
                        scale=None, *, k_scale=None, v_scale=None) -> torch.Tensor:
    """One layer's attention over a plan: tensor math only, one pass per planned group.

    ``q`` [T, Hq, D]; caches [num_pages, block_size, Hkv, D] on the plan's device.
    Returns [T, Hq, D] in ``q.dtype``; rows no planned row covers are zero.  FP8
    pages (kv_quant.py) are dequantized as they are gathered: ``float(page) * k_scale``
    (``v_scale``), a scale of None reading as 1.
    """
    _check_tensors(q, k_cache, v_cache)
    _check_against_plan(plan, q, k_cache)
    k_scale = 1.0 if k_scale is None else float(k_scale)
    v_scale = 1.0 if v_scale is None else float(v_scale)
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scale = softmax_scale(head_dim) if scale is None else float(scale)
    gqa = k_cache.shape[2] != num_q_heads
    flat_k = k_cache.reshape(-1, *k_cache.shape[2:])
    flat_v = v_cache.reshape(-1, *v_cache.shape[2:])
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    for group in plan.groups:
        k = _gather(flat_k, group.key_slots).to(compute).permute(0, 2, 1, 3)  # [g, Hkv, k, D]
        v = _gather(flat_v, group.key_slots).to(compute).permute(0, 2, 1, 3)
        if k_scale != 1.0 or v_scale != 1.0:
            k, v = k * k_scale, v * v_scale
        qg = _gather(q, group.q_rows).to(compute).permute(0, 2, 1, 3)         # [g, Hq, q, D]
        mask = group.mask
        if mask is None:
            mask = group.key_index < group.key_limit
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=gqa)
        o = o.permute(0, 2, 1, 3).reshape(-1, num_q_heads, head_dim)
        if group.kept is not None:
            # Integer (not boolean) indexing: no device sync on a GPU.
            o = o[group.kept]
        out.index_copy_(0, group.out_rows, o.to(q.dtype))
    return out


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
    dtype).  Returns [T, Hq, D] in ``q.dtype``; rows outside
    ``[query_start_loc[0], query_start_loc[-1])`` are zero.  The same as
    :func:`plan_paged_attention` then :func:`run_paged_attention`.
    """
    _check_tensors(q, k_cache, v_cache)
    num_pages, block_size, num_kv_heads, head_dim = k_cache.shape
    plan = plan_paged_attention(query_start_loc, seq_lens, block_table, block_size=block_size,
                                num_kv_heads=num_kv_heads, head_dim=head_dim,
                                num_q_heads=q.shape[1], kv_start=kv_start,
                                num_pages=num_pages, device=q.device)
    return run_paged_attention(plan, q, k_cache, v_cache, scale)


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
    num_pages, block_size = k_cache.shape[:2]
    qsl, seq, table, _ = validate_batch(query_start_loc, seq_lens, block_table, block_size)
    _check_rows(int(qsl[-1]) if qsl.size else 0, q)
    _check_pages(seq, table, np.zeros_like(seq), block_size, num_pages)
    vb = make_virtual_batches(qsl, seq, table, chunk_size, block_size)
    return paged_causal_attention(q, k_cache, v_cache, vb.query_start_loc, vb.seq_lens,
                                  vb.block_table, kv_start=vb.kv_start, scale=scale)
