"""Piecewise CUDA graphs on the GPU (engine/piecewise_graphs.py, switched on here): the
trained copy model (conftest.py) with prefill and mixed steps replayed as segments, bf16,
against transformers and against the same engine with those steps eager; and prompt logits
of padded prefill steps against the eager engine's (the CPU test with the stand-in is
tests/test_engine_flashinfer_cpu.py)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from chunklocal.engine import piecewise_graphs  # noqa: E402


@torch.inference_mode()
def test_engine_tokens_with_piecewise_graphs_match_transformers(copy_model, monkeypatch):
    from llama4_tiny import copy_prompts
    from test_engine_gpu import LENGTHS, NEW, engine, hf_generate, load_hf, same_fraction

    prompts = copy_prompts(LENGTHS, seed=2, vocab=128)
    eager = engine(copy_model).generate(prompts, max_new_tokens=NEW, ignore_eos=True)
    monkeypatch.setattr(piecewise_graphs, "PIECEWISE_ENABLED", True)
    llm = engine(copy_model)
    assert llm.runner.piecewise is not None
    outs = llm.generate(prompts, max_new_tokens=NEW, ignore_eos=True)
    assert llm.runner.piecewise_steps > 0 and llm.runner.graph_steps > 0
    assert same_fraction(outs, eager) >= 0.95
    refs = hf_generate(load_hf(copy_model, torch.bfloat16), prompts)
    assert same_fraction(outs, refs) >= 0.95


@torch.inference_mode()
def test_prompt_logits_with_piecewise_graphs_close_to_eager(copy_model, monkeypatch):
    """Prefill steps of several sizes (none a bucket: padded) replayed as segments: their
    prompt logits against the same engine's eager steps, within bf16 rounding."""
    from llama4_tiny import copy_prompts
    from test_engine_gpu import engine

    prompts = copy_prompts([37, 100, 301], seed=3, vocab=128)
    want = engine(copy_model).prompt_logits(prompts)
    monkeypatch.setattr(piecewise_graphs, "PIECEWISE_ENABLED", True)
    llm = engine(copy_model)
    got = llm.prompt_logits(prompts)
    assert llm.runner.piecewise_steps > 0 and llm.runner.piecewise.padding_rows > 0
    for g, w in zip(got, want, strict=True):
        assert (g.argmax(-1) == w.argmax(-1)).float().mean() >= 0.95
        torch.testing.assert_close(g, w, rtol=0.05, atol=0.25)
