"""The largest step's memory peak is reserved for good (engine/memory.py), so what a layer
keeps alive into its feed-forward costs KV pages: dead intermediates must be unreferenced
there.  Weak references to them must be dead when the next stage starts (CPU; on the H200
benchmarks/activation_peak.py measures the bytes)."""

from __future__ import annotations

import weakref

import torch

import chunklocal
from chunklocal.models import llama4
from chunklocal.models import moe as moe_module


def test_queries_keys_and_values_are_freed_before_the_feed_forward(ckpt, monkeypatch):
    path, _ = ckpt
    llm = chunklocal.LLM(path, dtype=torch.float32, max_num_seqs=2, max_model_len=64,
                         num_kv_blocks=16)
    refs: list[weakref.ref] = []
    project = llama4.Attention.project

    def recording(self, *args):
        q, k, v = project(self, *args)
        refs.extend(weakref.ref(t) for t in (q, k, v))
        return q, k, v

    alive_at_ff: list[int] = []
    for layer in llm.model.layers:
        forward = layer.feed_forward.forward

        def checked(x, _forward=forward):
            alive_at_ff.append(sum(r() is not None for r in refs))
            refs.clear()
            return _forward(x)

        layer.feed_forward.forward = checked
    monkeypatch.setattr(llama4.Attention, "project", recording)
    llm.generate([[3, 1, 4, 1, 5, 9, 2, 6]], max_new_tokens=3)
    assert alive_at_ff and alive_at_ff == [0] * len(alive_at_ff)


def test_moe_intermediates_are_freed_before_the_shared_expert(monkeypatch):
    """The routed experts' GEMM outputs (gate/up products, the down projection's rows) are
    gone when the shared expert starts."""
    from test_moe import hf_moe, ours_from

    ours = ours_from(hf_moe(8, 1, 0))
    refs: list[weakref.ref] = []
    expert_mm = moe_module.expert_mm

    def recording(*args, **kwargs):
        out = expert_mm(*args, **kwargs)
        refs.append(weakref.ref(out))
        return out

    alive: list[int] = []
    shared = ours.shared_expert.forward

    def checked(x):
        alive.append(sum(r() is not None for r in refs))
        return shared(x)

    monkeypatch.setattr(moe_module, "expert_mm", recording)
    ours.shared_expert.forward = checked
    with torch.no_grad():
        ours(torch.randn(40, 16))
    assert len(refs) == 2 and alive == [0]
