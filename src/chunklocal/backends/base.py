"""The contract between the engine and an attention backend.

FlashInfer's split, kept for every backend: ``build()`` runs once per step per
KV-cache group on the host (virtual batches, paged-KV metadata, planning) and
returns an opaque metadata object; ``forward()`` runs once per layer with that
object and makes no host decisions.  Layers of a group share one build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class EngineLimits:
    """Engine-wide limits that every buffer is sized from, once."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int


class AttentionBackend(Protocol):
    """One object per KV-cache group (a spec + its layers' head geometry)."""

    def build(self, query_start_loc: np.ndarray, seq_lens: np.ndarray,
              block_table: np.ndarray) -> Any:
        """Host work for one step: int32 numpy inputs, [N+1], [N], [N, W]."""

    def forward(self, metadata: Any, q: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q [tokens, Hq, D]; caches [num_pages, block_size, Hkv, D] (NHD); -> [tokens, Hq, D]."""
