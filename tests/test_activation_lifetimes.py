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


def test_a_layers_dead_tensors_are_freed_before_its_feed_forward(ckpt, monkeypatch):
    """When a layer's feed-forward starts, nothing references its inputs (the previous
    layer's output and residual stream), its queries/keys/values, the attention's output,
    o_proj's output or the residual stream before the second add: only the normed input
    of the feed-forward and the new residual stream are left."""
    path, _ = ckpt
    llm = chunklocal.LLM(path, dtype=torch.float32, max_num_seqs=2, max_model_len=64,
                         num_kv_blocks=16)
    refs: dict[str, weakref.ref] = {}
    layer_cls, attn_cls = llama4.DecoderLayer, llama4.Attention

    def record(name, fn):
        def wrapped(self, *args):
            out = fn(self, *args)
            for i, t in enumerate(out if isinstance(out, tuple) else (out,)):
                if isinstance(t, torch.Tensor):
                    refs[f"{name}[{i}]"] = weakref.ref(t)
            return out
        return wrapped

    before = layer_cls.before_attention

    def before_attention(self, h, residual, *args):
        refs["layer input h"] = weakref.ref(h)
        if residual is not None:
            refs["layer input residual"] = weakref.ref(residual)
        return record("before_attention", before)(self, h, residual, *args)

    monkeypatch.setattr(layer_cls, "before_attention", before_attention)
    for name in ("project", "attend", "output"):
        monkeypatch.setattr(attn_cls, name, record(name, getattr(attn_cls, name)))
    alive_at_ff: list[list[str]] = []
    for layer in llm.model.layers:
        forward = layer.feed_forward.forward

        def checked(x, _forward=forward):
            alive_at_ff.append(sorted(k for k, r in refs.items() if r() is not None))
            refs.clear()
            return _forward(x)

        layer.feed_forward.forward = checked
    llm.generate([[3, 1, 4, 1, 5, 9, 2, 6]], max_new_tokens=3)
    layers = len(llm.model.layers)
    assert len(alive_at_ff) == 3 * layers  # a prefill and two decodes
    assert alive_at_ff == [[]] * len(alive_at_ff)


def test_moe_intermediates_are_freed_before_the_combine(monkeypatch):
    """The shared expert runs before the routed experts (no routed intermediate exists
    then), and when the combine starts only the routed rows it reads are alive of the
    experts' GEMM outputs: the gate/up product is gone."""
    from test_moe import hf_moe, ours_from

    ours = ours_from(hf_moe(8, 1, 0))
    refs: list[weakref.ref] = []
    expert_mm, combine = moe_module.expert_mm, moe_module.routing.combine

    def recording(*args, **kwargs):
        out = expert_mm(*args, **kwargs)
        refs.append(weakref.ref(out))
        return out

    alive: list[int] = []
    shared = ours.shared_expert.forward

    def checked(x):
        alive.append(sum(r() is not None for r in refs))
        return shared(x)

    def combining(rows, *args):
        alive.append(sum(r() is not None for r in refs))
        assert refs[-1]() is rows
        return combine(rows, *args)

    monkeypatch.setattr(moe_module, "expert_mm", recording)
    monkeypatch.setattr(moe_module.routing, "combine", combining)
    ours.shared_expert.forward = checked
    with torch.no_grad():
        ours(torch.randn(40, 16))
    assert len(refs) == 2 and alive == [0, 1]
