"""FlashInfer driven straight from ``make_virtual_batches`` (no chunklocal builder).

Used as the fallback when ``chunklocal.backends.flashinfer`` is absent, and as a
cross-check of it: the same virtual batches, the same paged-KV arrays, planned
with FlashInfer's own wrappers.  Vectorised numpy, as a builder must be.
"""

from __future__ import annotations

import numpy as np

from chunklocal.backends.flashinfer.ragged import PagedKV, paged_kv_arrays
from chunklocal.virtual_batches import make_virtual_batches


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
