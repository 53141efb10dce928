"""CPU attention backend: the PyTorch reference over the paged cache.

One instance per KV group, the protocol of :mod:`chunklocal.backends.base`.
``build()`` validates the step once and returns one
:class:`~chunklocal.reference.PagedAttentionPlan` per layer kind: for the
chunked layers it cuts the batch into virtual batches (each row then starts its
keys at ``kv_start``), for the global layers it keeps the requests as they are;
a merged group (chunked and global layers on one block table) gets both from one
call.  ``forward()`` runs a plan (:func:`chunklocal.reference.run_paged_attention`):
tensor math, no validation, tiling or index building per layer.
"""

from __future__ import annotations

from typing import Any

import torch

from chunklocal.backends.base import Kind, pick_kind
from chunklocal.kv_spec import FullAttentionSpec, attention_kinds, chunk_size_of
from chunklocal.reference import PagedAttentionPlan, plan_validated, run_paged_attention
from chunklocal.virtual_batches import split_batch, validate_batch


class TorchRefBackend:
    """``num_q_heads`` sizes the plans' memory groups (None: as if Hq == Hkv);
    ``device`` is where the plans' index tensors live (that of q and the caches)."""

    #: No CUDA graphs (see backends/base.py).
    graph_batch_sizes: tuple[int, ...] = ()
    graph_query_lens: tuple[int, ...] = ()
    #: Each build makes new index tensors (synchronous copies from pageable memory).
    overlaps_eager_steps: bool = True

    def __init__(self, spec: FullAttentionSpec, num_q_heads: int | None = None, device="cpu"):
        self.block_size = spec.block_size
        self.chunk_size = chunk_size_of(spec)
        #: Layer kinds reading this group.
        self.kinds = attention_kinds(spec)
        self.geometry: dict[str, Any] = dict(
            block_size=spec.block_size, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            num_q_heads=num_q_heads, device=torch.device(device))

    def build(self, query_start_loc, seq_lens, block_table, *,
              graph_batch_size=None) -> dict[Kind, PagedAttentionPlan]:
        if graph_batch_size is not None:
            raise ValueError("TorchRefBackend has no CUDA-graph layouts "
                             f"(graph_batch_size={graph_batch_size})")
        qsl, seq_lens, block_table, query_lens = validate_batch(
            query_start_loc, seq_lens, block_table, self.block_size)
        plans = {}
        for kind in self.kinds:
            if kind is Kind.CHUNKED:
                vb = split_batch(qsl, seq_lens, block_table, query_lens, self.chunk_size,
                                 self.block_size)
                plans[kind] = plan_validated(vb.query_start_loc, vb.seq_lens, vb.block_table,
                                             vb.query_lens, kv_start=vb.kv_start,
                                             **self.geometry)
            else:
                plans[kind] = plan_validated(qsl, seq_lens, block_table, query_lens,
                                             **self.geometry)
        return plans

    def capture_step(self, batch_size: int, query_len: int):
        raise ValueError("TorchRefBackend has no CUDA-graph layouts "
                         f"(batch size {batch_size}, query length {query_len})")

    def forward(self, metadata: dict[Kind, PagedAttentionPlan], q, k_cache, v_cache,
                scale: float, *, kind: Kind | None = None, k_scale: float | None = None,
                v_scale: float | None = None, k=None, v=None):
        """``k_scale`` / ``v_scale``: FP8 pages' dequantization scales (kv_quant.py); ``k``
        / ``v`` (the step's own, also in the cache) are not needed here."""
        if kind not in metadata:  # the engine always passes a kind its group has
            kind = pick_kind(self.kinds, kind)
        return run_paged_attention(metadata[kind], q, k_cache, v_cache, scale,
                                   k_scale=k_scale, v_scale=v_scale)
