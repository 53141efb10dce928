"""Tensor-parallel layers over torch.distributed; with one rank they are the plain layers.

Every rank holds one shard of each parallel weight and runs the same code on the
same (replicated) input rows:

* :class:`ColumnParallelLinear` keeps a slice of the output features (rows of the
  ``[out, in]`` weight); its output is that slice of the full output, no
  communication.  ``replicas`` ranks may hold the same slice (KV heads when the
  tensor-parallel size exceeds ``num_key_value_heads``).
* :class:`RowParallelLinear` keeps a slice of the input features (columns); its
  output is a partial sum, made whole by one all-reduce (or left partial with
  ``reduce=False`` when a caller sums several partial outputs first, as the MoE
  layer does with its shared expert and its routed experts).
* :class:`VocabParallelEmbedding` keeps a slice of the vocabulary rows; tokens of
  other ranks' slices look up zeros, and an all-reduce sums the one real row.
* :class:`ParallelLMHead` keeps a slice of the vocabulary; an all-gather joins the
  logit columns in vocabulary order.

Each module lists its sharded parameters in ``shard_rules`` (name ->
:class:`ShardRule`); :func:`chunklocal.models.sharding.shard_rules` collects them
so a loader can cut each full checkpoint tensor to this rank's slice.  Rules live
on modules, not on parameters, because loading assigns new parameter objects.

With ``TPGroup.size == 1`` every rule is the identity and no collective runs: the
forward of each class is its ``torch.nn`` parent's (one extra attribute test).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in the tensor-parallel group, and the group's collectives.

    ``moe``: how MoE experts are split, "tp" (each expert's inner dimension) or
    "ep" (whole experts, ``num_local_experts / size`` per rank).
    """

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None: the default group
    moe: str = "tp"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in place (every rank gets bitwise the same sum)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()


@dataclass(frozen=True)
class ShardRule:
    """Slice ``index`` of ``num_shards`` equal slices along ``dim``.

    ``parts`` > 1: the dimension holds that many fused blocks (``[gate | up]``);
    each block is sliced and the slices are concatenated, so the local tensor is
    again ``[gate slice | up slice]``.
    """

    dim: int
    num_shards: int
    index: int
    parts: int = 1

    def local_size(self, full: int) -> int:
        return full // self.num_shards

    def take(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``full``, as a new tensor (the full one can be freed)."""
        size = full.shape[self.dim]
        if size % (self.parts * self.num_shards):
            raise ValueError(f"{name}: dimension {self.dim} of shape {tuple(full.shape)} does "
                             f"not split into {self.parts} x {self.num_shards} equal slices")
        if self.num_shards == 1:
            return full
        step = size // (self.parts * self.num_shards)
        blocks = full.chunk(self.parts, dim=self.dim)
        pieces = [b.narrow(self.dim, self.index * step, step) for b in blocks]
        return torch.cat(pieces, dim=self.dim) if self.parts > 1 else pieces[0].clone()


class ColumnParallelLinear(nn.Linear):
    """``y[:, slice] = x @ W[slice].T``: this rank's slice of the output features."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE,
                 replicas: int = 1):
        shards = tp.size // replicas
        super().__init__(in_features, out_features // shards, bias=bias)
        rule = ShardRule(0, shards, tp.rank // replicas)
        self.shard_rules = {"weight": rule, **({"bias": rule} if bias else {})}


class RowParallelLinear(nn.Linear):
    """``y = sum over ranks of x[:, slice] @ W[:, slice].T``; the bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE,
                 reduce: bool = True):
        super().__init__(in_features // tp.size, out_features, bias=bias)
        self.tp = tp
        self.reduce = reduce and tp.size > 1
        self.shard_rules = {"weight": ShardRule(1, tp.size, tp.rank)}

    def forward(self, x):
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        # Only rank 0 adds the bias, so the sum over ranks holds it once.
        out = F.linear(x, self.weight, self.bias if self.tp.rank == 0 else None)
        return self.tp.all_reduce(out) if self.reduce else out


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup = SINGLE):
        super().__init__(num_embeddings // tp.size, embedding_dim)
        self.tp = tp
        self.vocab_start = tp.rank * (num_embeddings // tp.size)
        self.shard_rules = {"weight": ShardRule(0, tp.size, tp.rank)}

    def forward(self, input_ids):
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        other = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(other, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(other.unsqueeze(-1), 0))


class ParallelLMHead(nn.Linear):
    """Logits of this rank's vocabulary slice, gathered into full rows."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup = SINGLE):
        super().__init__(hidden_size, vocab_size // tp.size, bias=False)
        self.tp = tp
        self.shard_rules = {"weight": ShardRule(0, tp.size, tp.rank)}

    def forward(self, hidden):
        return self.tp.all_gather_last(F.linear(hidden, self.weight))
