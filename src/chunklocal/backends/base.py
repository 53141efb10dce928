"""The whole contract between the engine and an attention backend.

FlashInfer's split, kept for every backend: ``build()`` runs once per step per
KV-cache group on the host (virtual batches, paged-KV metadata, planning) and
returns an opaque metadata object; ``forward()`` runs once per layer with that
object and makes no host decisions.  Layers of a group share one build.

``build()`` is the trust boundary: it validates the batch once (ValueError naming
the request and value) and passes the checked arrays down unchecked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from chunklocal.kv_spec import Kind

__all__ = ["AttentionBackend", "AttentionStep", "EngineLimits", "Kind", "pick_kind"]


@dataclass(frozen=True)
class EngineLimits:
    """Engine-wide limits that every buffer is sized from, once."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int


class AttentionBackend(Protocol):
    """One object per KV-cache group (a spec + its layers' head geometry).

    CUDA graphs are part of the contract: a backend that captures none has empty
    ``graph_batch_sizes``.  The engine captures one graph per (B, q) in
    ``graph_batch_sizes`` x ``graph_query_lens`` over :meth:`capture_step`'s
    metadata, and before each replay refreshes the same persistent metadata with
    ``build(..., graph_batch_size=B)``.
    """

    block_size: int
    #: Batch sizes B of the captured graphs (sorted; () when the backend has none).
    graph_batch_sizes: tuple[int, ...]
    #: Query lengths q of the captured graphs: (1,) decode, (1, k + 1) with verify.
    graph_query_lens: tuple[int, ...]
    #: Whether an eager step's ``build`` may run while the previous eager step is still
    #: queued on the device (nothing it stages on the host is reused by the next build
    #: before the previous one's copies ran): the engine then launches step n+1 before it
    #: collects step n (engine/overlap.py).  Graph replays always may.
    overlaps_eager_steps: bool

    def build(self, query_start_loc: np.ndarray, seq_lens: np.ndarray,
              block_table: np.ndarray, *, graph_batch_size: int | None = None) -> Any:
        """Host work for one step: int numpy inputs [N+1], [N], [N, W].

        ``graph_batch_size=B`` refreshes the persistent metadata of the captured
        (B, query length) CUDA graph instead (backends without graphs raise).
        """

    def capture_step(self, batch_size: int, query_len: int) -> Any:
        """The persistent metadata a (B, q) graph captures, filled with B padding
        requests (they read only the group's scratch page): what ``build(...,
        graph_batch_size=B)`` refreshes before each replay.  Backends without graphs
        raise ValueError."""

    def forward(self, metadata: Any, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, scale: float, *, kind: Kind | None = None,
                k_scale: float | None = None, v_scale: float | None = None,
                k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        """q [tokens, Hq, D]; caches [num_pages, block_size, Hkv, D] (NHD); -> [tokens, Hq, D].

        ``kind`` picks the layer kind in a group read by both (required there).
        ``k_scale`` / ``v_scale``: the dequantization scales of FP8 (e4m3) caches
        (chunklocal/kv_quant.py); passed only with such caches.  ``k`` / ``v`` [tokens,
        Hkv, D]: the step's own keys and values, already written to the cache; a backend
        may read them from there instead (16-bit caches; passed by the model).
        """


@dataclass
class AttentionStep:
    """What every layer of one attention kind needs for one step."""

    backend: AttentionBackend
    metadata: Any               # built once per step and KV group by backend.build()
    slot_mapping: torch.Tensor  # [tokens] int64: flat cache row of each token's K/V
    kind: Kind                  # which layer kind of the group's metadata to use


def pick_kind(kinds, kind: Kind | None) -> Kind:
    """The layer kind a forward call reads: ``kind``, or the group's only one."""
    if kind is None:
        if len(kinds) != 1:
            raise ValueError("this KV group has chunked and global layers: pass "
                             "kind=Kind.CHUNKED or kind=Kind.GLOBAL")
        return next(iter(kinds))
    if kind not in kinds:
        raise ValueError(f"kind={kind}: this KV group has no {kind.value} layers")
    return kind
