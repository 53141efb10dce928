"""Tiny random Llama-4 text checkpoints written by transformers, plus HF oracles.

The checkpoint is made by transformers' own ``Llama4ForCausalLM`` and
``save_pretrained`` (float32), so chunklocal loads exactly what a real
checkpoint directory holds.  ``floor_scale`` is small so that the NoPE layers'
attention temperature tuning is active at test lengths.
"""

from __future__ import annotations

import torch


def tiny_config(**overrides):
    from transformers import Llama4TextConfig

    values = dict(
        vocab_size=512, hidden_size=64, intermediate_size=64, intermediate_size_mlp=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        attention_chunk_size=32, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, max_position_embeddings=1024, floor_scale=16,
        attn_scale=0.5, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        initializer_range=0.1,
    )
    values.update(overrides)
    return Llama4TextConfig(**values)


def write_tiny_llama4(path, seed: int = 0, **overrides):
    """Save a random tiny Llama-4 to ``path``; return the transformers model (eval)."""
    from transformers import Llama4ForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(**overrides)
    config._attn_implementation = "eager"
    model = Llama4ForCausalLM(config).eval()
    model.save_pretrained(str(path))
    return model


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """Full-sequence (no cache) logits [len, vocab], float32."""
    return model(torch.tensor([tokens])).logits[0].float()


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())
