"""Tensor-parallel layers over torch.distributed; with one rank they are the plain layers.

Every rank holds one shard of each parallel weight and runs the same code on the
same (replicated) input rows:

* :func:`column_parallel` keeps a slice of the output features (rows of the
  ``[out, in]`` weight); its output is that slice of the full output, no
  communication.  ``replicas`` ranks may hold the same slice (KV heads when the
  tensor-parallel size exceeds ``num_key_value_heads``).
* :func:`row_parallel` keeps a slice of the input features (columns); its output
  is a partial sum.  The model all-reduces explicitly, once per sum: after the
  attention output projection, and after the MLP (or after the MoE layer's shared
  plus routed experts), so two all-reduces per decoder layer.
* :class:`VocabParallelEmbedding` keeps a slice of the vocabulary rows; the LM
  head is a column-parallel linear whose logit slices the model all-gathers.

Both linear helpers build the layer with a ``make(in, out, bias)`` factory (a plain
``nn.Linear`` by default, an FP8 linear where the checkpoint has one) and record
which parameters are sliced how in the module's ``shard_rules`` (name -> rule);
:func:`chunklocal.models.sharding.shard_rules` collects them so a loader can cut each
full checkpoint tensor to this rank's slice.  Rules live on modules, not on
parameters, because loading assigns new parameter objects.

With ``TPGroup.size == 1`` the layers are exactly the plain ones (no rules, no
wrapper), and the model calls no collective (it tests ``tp.size`` first), so a
one-rank decode step runs the code it ran before tensor parallelism existed.
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

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise max of ``x`` over the ranks (FP8 activation amax of a split row)."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
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


@dataclass(frozen=True)
class FirstRankOnly:
    """Rank 0 keeps the full tensor, the others zeros: a bias added before a sum over ranks."""

    index: int

    def take(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full if self.index == 0 else torch.zeros_like(full)


def plain_linear(in_features: int, out_features: int, bias: bool) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=bias)


def column_parallel(in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE,
                    replicas: int = 1, make=plain_linear) -> nn.Module:
    """``make(in, out / shards, bias)``: this rank's slice of the output features (rows of
    the weight, of its per-output-channel scale, of the bias).  ``replicas`` ranks hold the
    same slice (KV heads when the tensor-parallel size exceeds the KV head count)."""
    shards = tp.size // replicas
    layer = make(in_features, out_features // shards, bias)
    if tp.size > 1:
        rule = ShardRule(0, shards, tp.rank // replicas)
        layer.shard_rules = {"weight": rule, "weight_scale": rule, "bias": rule}
    return layer


def row_parallel(in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE,
                 make=plain_linear) -> nn.Module:
    """``make(in / N, out, bias)``: this rank's slice of the input features (columns).  Its
    output is a partial sum: the caller all-reduces it (once, after adding up any other
    partial sums).  Per-output-channel scales are whole on every rank; the bias is rank
    0's only, so the sum holds it once."""
    layer = make(in_features // tp.size, out_features, bias)
    if tp.size > 1:
        layer.shard_rules = {"weight": ShardRule(1, tp.size, tp.rank),
                             "bias": FirstRankOnly(tp.rank)}
        if hasattr(layer, "amax_reduce"):  # FP8: scale each token by its whole row's amax
            layer.amax_reduce = tp.all_reduce_max
    return layer


class VocabParallelEmbedding(nn.Embedding):
    """This rank's vocabulary rows; tokens of other ranks' rows look up zeros, and an
    all-reduce sums the one real row (exact in any dtype)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup):
        super().__init__(num_embeddings // tp.size, embedding_dim)
        self.tp = tp
        self.vocab_start = tp.rank * (num_embeddings // tp.size)
        self.shard_rules = {"weight": ShardRule(0, tp.size, tp.rank)}

    def forward(self, input_ids):
        local = input_ids - self.vocab_start
        other = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(other, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(other.unsqueeze(-1), 0))


def vocab_embedding(num_embeddings: int, embedding_dim: int, tp: TPGroup = SINGLE):
    if tp.size == 1:
        return nn.Embedding(num_embeddings, embedding_dim)
    return VocabParallelEmbedding(num_embeddings, embedding_dim, tp)
