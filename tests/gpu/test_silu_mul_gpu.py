"""FlashInfer's silu_and_mul (``fused.gated_act`` with ``SILU_MUL_ENABLED``), compiled on
the GPU: against float64 on bf16 rows of Scout's expert and dense MLP widths and of very
different magnitudes (it rounds once where torch's SiLU-then-product rounds twice, so it is
held to the float64 value, not to torch's bits), replayed in a CUDA graph with new inputs,
and the trained copy model's greedy tokens with it on against transformers.  The CPU test
with the strict stand-in is tests/test_fused.py."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from gpu_rows import spread_rows  # noqa: E402
from torch import nn  # noqa: E402

from chunklocal.models import fused  # noqa: E402


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setattr(fused, "SILU_MUL_ENABLED", True)


@pytest.mark.parametrize("inner", [8192, 16384])  # Scout experts; Maverick dense MLPs
@pytest.mark.parametrize("m", [1, 7, 64, 4096])
def test_silu_and_mul_within_half_a_bf16_unit_of_float64(on, m, inner):
    gate_up = spread_rows(m, 2 * inner, seed=m, decades=2).cuda()
    assert fused.silu_mul_available(gate_up, nn.SiLU())
    got = fused.gated_act(gate_up, nn.SiLU())
    gate, up = gate_up.double().chunk(2, dim=-1)
    want = gate * torch.sigmoid(gate) * up
    assert got.dtype == torch.bfloat16 and got.shape == (m, inner)
    # one rounding to bf16 (2**-9 relative) and float32 arithmetic before it
    assert ((got.double() - want).abs() <= want.abs() * 2.0**-8 + 1e-30).all()


@torch.inference_mode()
def test_silu_and_mul_replays_in_a_cuda_graph(on):
    gate_up = torch.zeros(16, 2 * 512, dtype=torch.bfloat16, device="cuda")
    fused.gated_act(gate_up, nn.SiLU())  # compile and load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused.gated_act(gate_up, nn.SiLU())
    for seed in range(3):
        gate_up.copy_(spread_rows(16, 2 * 512, seed=seed, decades=1))
        graph.replay()
        assert torch.equal(out, fused.gated_act(gate_up, nn.SiLU()))


@torch.inference_mode()
def test_engine_tokens_with_silu_and_mul_match_transformers(copy_model, on, monkeypatch):
    """The trained copy model (conftest.py) with the kernel on: greedy tokens, CUDA graphs,
    against transformers bf16, as test_engine_gpu's bf16 test asks of the default path."""
    import flashinfer.activation
    from llama4_tiny import copy_prompts
    from test_engine_gpu import LENGTHS, NEW, engine, hf_generate, load_hf, same_fraction

    calls, real = [], flashinfer.activation.silu_and_mul
    monkeypatch.setattr(flashinfer.activation, "silu_and_mul",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = copy_prompts(LENGTHS, seed=1, vocab=128)
    llm = engine(copy_model)
    outs = llm.generate(prompts, max_new_tokens=NEW, ignore_eos=True)
    assert calls and llm.runner.graph_steps > 0
    refs = hf_generate(load_hf(copy_model, torch.bfloat16), prompts)
    assert same_fraction(outs, refs) >= 0.95
