"""chunklocal.LLM on MoE checkpoints against transformers' greedy tokens (float32, CPU).

Steps carry hundreds of tokens (max_num_batched_tokens=512, prompts of 90..430), so
each MoE layer sorts and groups hundreds of (token, expert) pairs per step; the
decode steps that follow carry one token per request.  transformers' ``Llama4TextMoe``
runs every expert on every token, so it is an independent oracle for the routing.
"""

from __future__ import annotations

import pytest
import torch
from llama4_tiny import hf_greedy, hf_logits, prompts_of, rel_err, write_tiny_llama4

import chunklocal
from chunklocal.models import moe
from chunklocal.models.moe import MoE

LENGTHS = [300, 170, 430, 90]
ENGINE = dict(device="cpu", dtype=torch.float32, max_model_len=512, max_num_seqs=4,
              max_num_batched_tokens=512, block_size=4)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module", params=[(2, 8, 1), (1, 16, 2)],
                ids=["top2-of-8-every-layer", "top1-of-16-every-other"])
def moe_ckpt(request, tmp_path_factory):
    top_k, num_experts, step = request.param
    path = tmp_path_factory.mktemp(f"moe_top{top_k}")
    hf = write_tiny_llama4(path, seed=21, num_local_experts=num_experts, num_experts_per_tok=top_k,
                           interleave_moe_layer_step=step)
    return path, hf


def moe_layers(llm):
    return [m for m in llm.model.modules() if isinstance(m, MoE)]


@pytest.mark.parametrize("mode", ["separate", "stacked", "fused"])
def test_greedy_tokens_equal_transformers(moe_ckpt, mode, monkeypatch):
    """``mode``: the shared expert as transformers holds it, or stacked into slot E at
    load (moe.STACK_SHARED) and run dense, or as group E of the grouped GEMMs."""
    path, hf = moe_ckpt
    if mode != "separate":
        monkeypatch.setattr(moe, "STACK_SHARED", True)
        monkeypatch.setattr(moe, "FUSE_MAX_TOKENS", 10**6 if mode == "fused" else 0)
    llm = chunklocal.LLM(path, **ENGINE)
    layers = moe_layers(llm)
    assert len(layers) == len(hf.config.moe_layers) > 0
    for layer in layers:
        assert layer.top_k == hf.config.num_experts_per_tok
        assert layer.stacked == (mode != "separate")
        assert (layer.shared_expert is None) == layer.stacked
    prompts = prompts_of(LENGTHS, seed=8)
    outputs = llm.generate(prompts, max_new_tokens=20)
    assert max(llm.runner.tokens_per_step) >= 400  # prefill steps of hundreds of tokens
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        assert out == hf_greedy(hf, prompt, 20), f"prompt {i} (len {len(prompt)})"
    if mode == "separate":
        for prompt, got in zip(prompts, llm.prompt_logits(prompts), strict=True):
            assert rel_err(got, hf_logits(hf, prompt)) < 1e-4
