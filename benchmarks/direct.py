"""FlashInfer driven straight from ``make_virtual_batches`` (no chunklocal builder).

Used as the fallback when ``chunklocal.backends.flashinfer`` is absent, and as a
cross-check of it: the same virtual batches, the same paged-KV arrays, planned
with FlashInfer's own wrappers.  Vectorised numpy, as a builder must be.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from chunklocal.virtual_batches import make_virtual_batches


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


def host_metadata(query_start_loc, seq_lens, block_table, block_size: int,
                  chunk_size: int | None) -> PagedKV:
    """The host work of one step for one KV group: virtual batches (if chunked) + paged KV."""
    if chunk_size is None:
        return paged_kv_arrays(query_start_loc, seq_lens, block_table, block_size)
    vb = make_virtual_batches(query_start_loc, seq_lens, block_table, chunk_size, block_size)
    return paged_kv_arrays(vb.query_start_loc, vb.seq_lens, vb.block_table, block_size)


class DirectRunner:
    """One FlashInfer wrapper planned on :func:`host_metadata`'s arrays.

    ``decode=True`` uses the tensor-core decode wrapper (GQA group 5 needs it);
    otherwise the causal paged prefill wrapper.
    """

    def __init__(self, device, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, decode: bool, workspace_bytes: int = 512 << 20):
        import flashinfer
        import torch

        self.device = device
        self.heads = (num_q_heads, num_kv_heads, head_dim)
        self.block_size = block_size
        self.decode = decode
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        if decode:
            self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=True)
        else:
            self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def plan(self, meta: PagedKV, dtype) -> None:
        import torch

        hq, hkv, d = self.heads

        def dev(a):
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)

        if self.decode:
            self.wrapper.plan(dev(meta.kv_indptr), dev(meta.kv_indices), dev(meta.last_page_len),
                              hq, hkv, d, self.block_size, q_data_type=dtype,
                              kv_data_type=dtype)
        else:
            self.wrapper.plan(dev(meta.qo_indptr), dev(meta.kv_indptr), dev(meta.kv_indices),
                              dev(meta.last_page_len), hq, hkv, d, self.block_size,
                              causal=True, q_data_type=dtype, kv_data_type=dtype)

    def run(self, q, kv_cache, out=None):
        return self.wrapper.run(q, kv_cache, out=out)
