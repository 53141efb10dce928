"""Tensor parallelism simulated in one process: one thread per rank, collectives by barrier.

Each rank's model holds the slices ``chunklocal.models.sharding.shard_rules`` cuts from
a full model's weights; :class:`SimTP` sums (or gathers) the ranks' tensors in rank
order, so every rank gets bitwise the same result, as with gloo or NCCL.  Cheap
enough for property tests over tensor-parallel sizes and head layouts; the real
torch.distributed path is tested with processes in test_tp_engine.py.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from chunklocal.backends.base import AttentionStep, Kind
from chunklocal.backends.torch_ref import TorchRefBackend
from chunklocal.kv_spec import FullAttentionSpec
from chunklocal.models.llama4 import Llama4ForCausalLM
from chunklocal.models.parallel import TPGroup
from chunklocal.models.sharding import shard_rules


class Exchange:
    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list = [None] * size


@dataclass(frozen=True)
class SimTP(TPGroup):
    exchange: Exchange | None = None

    def _share(self, x):
        ex = self.exchange
        ex.slots[self.rank] = x.clone()
        ex.barrier.wait()
        parts = list(ex.slots)
        ex.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return parts

    def all_reduce(self, x):
        if self.size == 1:
            return x
        parts = self._share(x)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return x.copy_(total)

    def all_reduce_max(self, x):
        if self.size == 1:
            return x
        parts = self._share(x)
        total = parts[0].clone()
        for part in parts[1:]:
            total = torch.maximum(total, part)
        return x.copy_(total)

    def all_gather_last(self, x):
        return x if self.size == 1 else torch.cat(self._share(x), dim=-1)


def groups(size: int, moe: str = "tp") -> list[SimTP]:
    ex = Exchange(size)
    return [SimTP(rank, size, None, moe, ex) for rank in range(size)]


def run_ranks(fn, ranks):
    """``fn(rank_object)`` in one thread per rank; the results in rank order."""
    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(fn, ranks))


def random_full_state(config, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = Llama4ForCausalLM(config)
    return {name: torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0)
            for name, p in model.state_dict().items()}


def rank_model(config, full_state, tp: TPGroup) -> Llama4ForCausalLM:
    """This rank's model, cut from the full weights by the modules' shard rules."""
    with torch.device("meta"):
        model = Llama4ForCausalLM(config, tp=tp)
    rules = shard_rules(model)
    state = {n: rules[n].take(n, t) if n in rules else t for n, t in full_state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.eval().init_rope("cpu")
    return model


@torch.inference_mode()
def prefill_logits(model, ids: list[int], block_size: int = 4) -> torch.Tensor:
    """Logits [len(ids), vocab] of one request prefilled in one step (merged KV group)."""
    attn = model.layers[0].self_attn
    t = len(ids)
    pages = -(-t // block_size)
    spec = FullAttentionSpec(block_size, attn.num_kv_heads, attn.head_dim, torch.float32,
                             attention_chunk_size=model.config.attention_chunk_size)
    backend = TorchRefBackend(spec, num_q_heads=attn.num_heads)
    for layer in model.layers:
        shape = (pages + 1, block_size, attn.num_kv_heads, attn.head_dim)
        layer.self_attn.k_cache = torch.zeros(shape)
        layer.self_attn.v_cache = torch.zeros(shape)
    metadata = backend.build(np.array([0, t], np.int32), np.array([t], np.int32),
                             np.arange(pages, dtype=np.int32)[None])
    slots = torch.arange(t)
    steps = {kind: AttentionStep(backend, metadata, slots, kind) for kind in Kind}
    positions = torch.arange(t)
    return model.compute_logits(model(torch.tensor(ids), positions, steps))
