"""CPU attention backend: the PyTorch reference over the paged cache.

One instance per KV group, the same protocol as the FlashInfer backend.
``build()`` does the step's host work once per group: for the chunked layers it
cuts the batch into virtual batches (each row then starts its keys at
``kv_start``), for the global layers it keeps the requests as they are; a merged
group (chunked and global layers on one block table) gets both from one call.
``forward()`` hands the prepared rows to :func:`chunklocal.reference.paged_causal_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from chunklocal.kv_spec import chunk_size_of, needs_global_pages
from chunklocal.reference import paged_causal_attention
from chunklocal.virtual_batches import make_virtual_batches


@dataclass(frozen=True)
class Rows:
    """The attention problems one layer kind solves in a step."""

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_table: np.ndarray
    kv_start: np.ndarray | None


class TorchRefBackend:
    def __init__(self, spec):
        self.block_size = spec.block_size
        self.chunk = chunk_size_of(spec)
        #: Layer kinds reading this group: True = chunked, False = global.
        self.kinds = ((True,) if self.chunk else ()) + ((False,) if needs_global_pages(spec)
                                                        else ())

    def build(self, query_start_loc, seq_lens, block_table) -> dict[bool, Rows]:
        rows = {}
        for chunked in self.kinds:
            if chunked:
                vb = make_virtual_batches(query_start_loc, seq_lens, block_table, self.chunk,
                                          self.block_size)
                rows[True] = Rows(vb.query_start_loc, vb.seq_lens, vb.block_table, vb.kv_start)
            else:
                rows[False] = Rows(np.asarray(query_start_loc), np.asarray(seq_lens),
                                   np.asarray(block_table), None)
        return rows

    def forward(self, metadata: dict[bool, Rows], q, k_cache, v_cache, scale: float, *,
                chunked: bool | None = None):
        if chunked is None:
            if len(self.kinds) != 1:
                raise ValueError("a merged group needs chunked=True or chunked=False")
            chunked = self.kinds[0]
        rows = metadata[chunked]
        return paged_causal_attention(q, k_cache, v_cache, rows.query_start_loc, rows.seq_lens,
                                      rows.block_table, kv_start=rows.kv_start, scale=scale)
