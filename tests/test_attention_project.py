"""Attention.project's query temperature (the NoPE layers' ``attn_temperature_tuning``):
the product taken in float32 and rounded once to the queries' dtype, in place."""

from __future__ import annotations

import pytest
import torch
from llama4_tiny import write_tiny_llama4

import chunklocal

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@torch.inference_mode()
def test_nope_queries_scaled_in_float32_and_rounded_once(tmp_path):
    """bf16 queries times the float32 temperature: the bits of ``(q * q_scale).to(bf16)``
    (a bf16 product -- the scale rounded to bf16 first -- differs in some elements)."""
    write_tiny_llama4(tmp_path, seed=3, attn_temperature_tuning=True, no_rope_layers=[1, 0, 1, 0])
    llm = chunklocal.LLM(str(tmp_path), device="cpu", dtype=torch.bfloat16, max_model_len=256)
    attn = llm.model.layers[1].self_attn
    assert attn.temperature_tuning and not attn.use_rope
    positions = torch.arange(0, 4000, 17)  # past floor_scale many times: scales far from 1
    freqs_cis, q_scale = llm.model.rope_inputs(positions)
    assert q_scale is not None and q_scale.dtype == torch.float32
    x = torch.randn(positions.shape[0], llm.model.config.hidden_size).to(torch.bfloat16)
    attn.temperature_tuning = False
    raw, k0, v0 = attn.project(x, q_scale, freqs_cis)
    attn.temperature_tuning = True
    q, k, v = attn.project(x, q_scale, freqs_cis)
    want = (raw.float() * q_scale).to(torch.bfloat16)
    assert torch.equal(q, want)
    assert torch.equal(k, k0) and torch.equal(v, v0)  # the slices beside q untouched
    rounded_twice = raw * q_scale.to(torch.bfloat16)
    assert not torch.equal(rounded_twice, want)  # the check can tell the two apart
