"""CPU attention backend: the PyTorch reference over the paged cache.

One instance per KV group, the same protocol as the FlashInfer backend.
``build()`` does the step's host work once per group and returns one
:class:`~chunklocal.reference.PagedAttentionPlan` per layer kind: for the
chunked layers it cuts the batch into virtual batches (each row then starts its
keys at ``kv_start``), for the global layers it keeps the requests as they are;
a merged group (chunked and global layers on one block table) gets both from one
call.  ``forward()`` runs a plan (:func:`chunklocal.reference.run_paged_attention`):
tensor math, no validation, tiling or index building per layer.
"""

from __future__ import annotations

import torch

from chunklocal.kv_spec import attention_kinds, chunk_size_of
from chunklocal.reference import PagedAttentionPlan, plan_paged_attention, run_paged_attention
from chunklocal.virtual_batches import make_virtual_batches


class TorchRefBackend:
    """``num_q_heads`` sizes the plans' memory groups (None: as if Hq == Hkv);
    ``device`` is where the plans' index tensors live (that of q and the caches)."""

    def __init__(self, spec, num_q_heads: int | None = None, device="cpu"):
        self.block_size = spec.block_size
        self.chunk = chunk_size_of(spec)
        #: Layer kinds reading this group: True = chunked, False = global.
        self.kinds = attention_kinds(spec)
        self.geometry = dict(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                             head_dim=spec.head_size, num_q_heads=num_q_heads,
                             device=torch.device(device))

    def build(self, query_start_loc, seq_lens, block_table) -> dict[bool, PagedAttentionPlan]:
        plans = {}
        for chunked in self.kinds:
            if chunked:
                vb = make_virtual_batches(query_start_loc, seq_lens, block_table, self.chunk,
                                          self.block_size)
                plans[True] = plan_paged_attention(vb.query_start_loc, vb.seq_lens,
                                                   vb.block_table, kv_start=vb.kv_start,
                                                   **self.geometry)
            else:
                plans[False] = plan_paged_attention(query_start_loc, seq_lens, block_table,
                                                    **self.geometry)
        return plans

    def forward(self, metadata: dict[bool, PagedAttentionPlan], q, k_cache, v_cache,
                scale: float, *, chunked: bool | None = None):
        if chunked is None:
            if len(self.kinds) != 1:
                raise ValueError("a merged group needs chunked=True or chunked=False")
            chunked = self.kinds[0]
        if chunked not in metadata:
            kind = "chunked" if chunked else "global"
            raise ValueError(f"chunked={chunked}: this KV group has no {kind} layers")
        return run_paged_attention(metadata[chunked], q, k_cache, v_cache, scale)
