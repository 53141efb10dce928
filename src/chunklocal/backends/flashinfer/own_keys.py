"""The eager ragged path's plan and run: the step's own keys from its K/V, the earlier keys
paged or gathered (:mod:`.ragged` splits them; backend.py decides when, per step:
``RAGGED_OWN_KEYS``, ``RAGGED_EARLIER``).

Per kind and step: the own keys' ragged wrapper (causal), then for the rows that also read
earlier keys either the paged wrapper (non-causal) or, for long segments, gathered blocks:
each block's keys copied from the pages into :class:`GatherBuffers` and read by one more
ragged wrapper (non-causal).  Every part's output is merged into the own keys' by
log-sum-exp; a row may be in several parts (a long segment's consecutive blocks, and its
paged prefix once the blocks are full), so the running log-sum-exp is kept.
"""

from __future__ import annotations

from typing import Any

import torch

from chunklocal.backends.flashinfer.ragged import ragged_split, split_earlier

__all__ = ["GatherBuffers", "OwnKeys", "plan_own_keys", "run_own_keys"]


#: ``rows`` of a part that every row of the step reads (a long prompt's later steps on
#: global layers): its queries are ``q`` itself and its merge replaces the result, with
#: no rows gathered from q, o and the LSE nor copied back (four passes over o's bytes).
ALL_ROWS = "all"


class OwnKeys:
    """A kind's eager step on the ragged path: the ragged wrapper (the step's own keys),
    the paged one (None where no row reads earlier keys there) with its rows, and the
    gathered blocks of earlier keys: (ragged wrapper, rows, cache rows, keys) each.  Rows:
    a device tensor of step rows, or :data:`ALL_ROWS`."""

    def __init__(self, ragged, earlier, rows, blocks: tuple = ()):
        self.ragged, self.earlier, self.rows, self.blocks = ragged, earlier, rows, blocks


class GatherBuffers:
    """K and V of ``keys`` rows ``[num_kv_heads, head_dim]`` each
    (bounds/sizing.gathered_key_capacity), made by the first :meth:`get`: the backend
    calls it at construction when the gathered path is on, so the memory profile's step
    counts them.  ``keys`` also caps a block (the split cuts blocks that fit)."""

    def __init__(self, keys: int, num_kv_heads: int, head_dim: int, dtype, device):
        self.keys, self.shape_tail = keys, (num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._kv is None or self._kv[0].shape[0] < self.keys:
            shape = (self.keys, *self.shape_tail)
            self._kv = (torch.empty(shape, dtype=self.dtype, device=self.device),
                        torch.empty(shape, dtype=self.dtype, device=self.device))
        return self._kv


def plan_own_keys(backend, state, parity: int, qsl, seq_lens, block_table,
                  gather: tuple[int, int, int] | None) -> OwnKeys | None:
    """Plan one kind's eager step (``state``: the backend's per-kind state, its wrappers and
    host staging of eager step ``parity``).  ``gather``: (keys a block holds, rows a
    segment needs, blocks a step may use) to gather long segments' earlier keys; None
    keeps them paged."""
    split = ragged_split(qsl, seq_lens, block_table, state.chunk_size, backend.block_size)
    if split.num_batches == 0 or split.qo_indptr[-1] == 0:
        return None
    ragged, earlier, host = state.own_keys(parity)
    heads = (backend.num_q_heads, backend.num_kv_heads, backend.head_dim)
    kwargs = backend._plan_kwargs()
    # one buffer per array: a plan's copies from them may still be queued
    qo = host.put("ragged_qo_indptr", split.qo_indptr)
    ragged.plan(qo, qo, *heads, causal=True, **kwargs)
    if not split.paged_rows.size:
        return OwnKeys(ragged, None, None)
    paged_rows, p = split.paged_rows, split.paged
    blocks: tuple[tuple, ...] = ()
    if gather is not None:
        parts = split_earlier(split, backend.block_size, gather[1], gather[0], gather[2])
        paged_rows, p = parts.paged_rows, parts.paged
        blocks = tuple(plan_block(backend, state, parity, i, block, host,
                                  int(split.qo_indptr[-1]), kwargs)
                       for i, block in enumerate(parts.blocks))
    if not paged_rows.size:
        return OwnKeys(ragged, None, None, blocks)
    earlier.plan(*(host.put(f"paged_{name}", getattr(p, name)) for name in (
        "qo_indptr", "kv_indptr", "kv_indices", "last_page_len")), *heads,
        backend.block_size, causal=False, **kwargs)
    return OwnKeys(ragged, earlier, _device_rows(backend, host, "rows", paged_rows,
                                                 int(split.qo_indptr[-1])), blocks)


def _device_rows(backend, host, name: str, rows, num_tokens: int):
    """``rows`` (distinct step rows, ascending) on the device, or :data:`ALL_ROWS` when
    they are every row of the step."""
    if rows.shape[0] == num_tokens:
        return ALL_ROWS
    return host.put(name, rows).to(backend.device, non_blocking=True)


def plan_block(backend, state, parity: int, index: int, block, host, num_tokens: int,
               plan_kwargs: dict) -> tuple:
    """Plan gathered block ``index``: its wrapper, and its rows and cache rows on the
    device (copied from page-locked staging, one buffer per array and block)."""
    wrapper = state.block_wrapper(parity, index)
    wrapper.plan(host.put(f"block{index}_qo", block.qo_indptr),
                 host.put(f"block{index}_kv", block.kv_indptr), backend.num_q_heads,
                 backend.num_kv_heads, backend.head_dim, causal=False, **plan_kwargs)
    rows = _device_rows(backend, host, f"block{index}_rows", block.rows, num_tokens)
    cache_rows = host.put(f"block{index}_cache_rows", block.cache_rows).to(
        backend.device, non_blocking=True)
    return wrapper, rows, cache_rows, int(block.cache_rows.shape[0])


def run_own_keys(step: OwnKeys, q, k, v, k_cache, v_cache, q_scale, merge_state: Any,
                 gather: GatherBuffers) -> torch.Tensor:
    """Attention of one layer's step on the ragged path: a new ``[tokens, Hq, D]``."""
    # k and v as the projection left them (v, and a NoPE layer's k, are strided views of
    # the fused q/k/v output): FlashInfer's ragged kernels (FA2 and FA3) take the token and
    # head strides (``k.stride(0)``, ``k.stride(1)``), where ``.contiguous()`` copied both
    # [T, Hkv, D] tensors of every layer (a 12-layer 8k prefill step: 15 copies, 0.4 ms)
    o, lse = step.ragged.run(q, k, v, q_scale=q_scale, return_lse=True)
    if step.earlier is not None:
        o, lse = _merge_part(step.rows, lambda rows_q: step.earlier.run(
            rows_q, (k_cache, v_cache), q_scale=q_scale, return_lse=True), q, o, lse,
            merge_state)
    for wrapper, rows, cache_rows, num_keys in step.blocks:  # rows apart from the paged
        # its keys copied from the pages into the gather buffers (after the last block's
        # kernel read them: one stream); a long segment's next block merges on top
        buf_k, buf_v = gather.get()
        tail = gather.shape_tail
        keys, values = buf_k[:num_keys], buf_v[:num_keys]
        torch.index_select(k_cache.view(-1, *tail), 0, cache_rows, out=keys)
        torch.index_select(v_cache.view(-1, *tail), 0, cache_rows, out=values)
        o, lse = _merge_part(rows, lambda rows_q, w=wrapper, kv=(keys, values): w.run(
            rows_q, *kv, q_scale=q_scale, return_lse=True), q, o, lse, merge_state)
    return o


def _merge_part(rows, run, q, o, lse, merge_state):
    """(o, lse) with one part's (output, LSE) over ``rows`` merged in: the part run on
    those rows' queries.  Every row (:data:`ALL_ROWS`): new tensors, nothing gathered;
    else ``o`` and ``lse`` updated in place at ``rows``."""
    if rows is ALL_ROWS:
        return merge_state(o, lse, *run(q))
    merged, merged_lse = merge_state(o.index_select(0, rows), lse.index_select(0, rows),
                                     *run(q.index_select(0, rows)))
    o.index_copy_(0, rows, merged)
    lse.index_copy_(0, rows, merged_lse)
    return o, lse
