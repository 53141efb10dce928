"""CPU attention backend: the PyTorch reference over the paged cache.

``build()`` does the step's host work once per KV group and attention kind: for a
chunked group it cuts the batch into virtual batches (each row then starts its
keys at ``kv_start``), for a global group it keeps the requests as they are.
``forward()`` hands the prepared rows to :func:`chunklocal.reference.paged_causal_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from chunklocal.reference import paged_causal_attention
from chunklocal.virtual_batches import make_virtual_batches


@dataclass(frozen=True)
class TorchRefMetadata:
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    kv_start: np.ndarray | None
    num_batches: int  # rows the kernel sees (virtual batches for a chunked group)


class TorchRefBackend:
    """One instance per (KV group, attention kind); ``chunk_size=None`` means global."""

    def __init__(self, chunk_size: int | None, block_size: int):
        self.chunk_size = chunk_size
        self.block_size = block_size

    def build(self, query_start_loc, seq_lens, block_table) -> TorchRefMetadata:
        if self.chunk_size is None:
            return TorchRefMetadata(np.asarray(query_start_loc), np.asarray(seq_lens),
                                    np.asarray(block_table), None, len(seq_lens))
        vb = make_virtual_batches(query_start_loc, seq_lens, block_table, self.chunk_size,
                                  self.block_size)
        return TorchRefMetadata(vb.query_start_loc, vb.seq_lens, vb.block_table, vb.kv_start,
                                vb.num_batches)

    def forward(self, metadata: TorchRefMetadata, q, k_cache, v_cache, scale: float):
        return paged_causal_attention(q, k_cache, v_cache, metadata.query_start_loc,
                                      metadata.seq_lens, metadata.block_table,
                                      kv_start=metadata.kv_start, scale=scale)
