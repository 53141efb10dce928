"""Llama-4 text model over flat token batches and a paged KV cache.

Layers see ``[tokens, hidden]`` with one absolute position per token; requests
are told apart only by the attention metadata.  RoPE layers attend chunk-locally
(the ``chunked`` attention kind), NoPE layers globally (``global``); each kind
gets one backend metadata object per step (see :class:`AttentionStep`).

Numerics follow transformers' ``Llama4ForCausalLM``: RoPE as a complex product
over interleaved pairs ``(x[2i], x[2i+1])`` in float32, L2 qk-norm after RoPE on
RoPE layers only, temperature tuning of the queries on NoPE layers, a top-k
router whose sigmoid scores scale the expert *inputs*, a shared expert, and the
dense MLP width ``intermediate_size_mlp`` on non-MoE layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from chunklocal.models.llama4_config import (  # noqa: F401  (re-exported)
    CHUNKED,
    GLOBAL,
    activation,
    layer_kind,
    load_text_config,
    require_hf,
    rope_parameters,
    supported_rope_type,
)
from chunklocal.models.quant import FP8, NO_FP8, Fp8Plan, fp8_grouped_mm, fp8_linear


@dataclass
class AttentionStep:
    """What every layer of one attention kind needs for one step."""

    backend: Any            # forward(metadata, q, k_cache, v_cache, scale, chunked=...)
    metadata: Any           # built once per step and KV group by backend.build()
    slot_mapping: torch.Tensor  # [tokens] int64: flat cache row of each token's K/V
    chunked: bool           # which layer kind of the group's metadata to use


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x):
        return _rms(x, self.eps) * self.weight


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inner: int, act: nn.Module, fp8: Fp8Plan = NO_FP8,
                 prefix: str = ""):
        super().__init__()
        self.act = act
        self.gate_proj = fp8.linear(f"{prefix}.gate_proj", hidden, inner)
        self.up_proj = fp8.linear(f"{prefix}.up_proj", hidden, inner)
        self.down_proj = fp8.linear(f"{prefix}.down_proj", inner, hidden)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Routed experts as (N, K) matrices: ``w13 [E, 2*inner, hidden]`` (gate rows, then up
    rows) and ``w2 [E, hidden, inner]``.  FP8: float8_e4m3fn with float32 per-output-channel
    scales ``w13_scale [E, 2*inner]`` and ``w2_scale [E, hidden]``."""

    def __init__(self, num_experts: int, hidden: int, inner: int, act: nn.Module,
                 fp8: bool = False, act_scale_ub: float | None = None):
        super().__init__()
        self.act, self.fp8, self.act_scale_ub = act, fp8, act_scale_ub
        dtype = FP8 if fp8 else None
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden, dtype=dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, inner, dtype=dtype),
                               requires_grad=False)
        if fp8:
            self.w13_scale = nn.Parameter(torch.empty(num_experts, 2 * inner), requires_grad=False)
            self.w2_scale = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)

    def run(self, expert, x):
        if self.fp8:
            gate, up = fp8_linear(x, self.w13[expert], self.w13_scale[expert],
                                  act_scale_ub=self.act_scale_ub).chunk(2, dim=-1)
            return fp8_linear(self.act(gate) * up, self.w2[expert], self.w2_scale[expert],
                              act_scale_ub=self.act_scale_ub)
        gate, up = (x @ self.w13[expert].t()).chunk(2, dim=-1)
        return (self.act(gate) * up) @ self.w2[expert].t()

    def run_all(self, x_per_expert):
        """x_per_expert [E, T, H] -> [E, T, H]; shape-static (CUDA-graph safe)."""
        if self.fp8:
            num_experts, tokens, hidden = x_per_expert.shape
            offs = torch.arange(1, num_experts + 1, device=x_per_expert.device,
                                dtype=torch.int32) * tokens
            flat = x_per_expert.reshape(-1, hidden)
            gate, up = fp8_grouped_mm(flat, self.w13, self.w13_scale, offs,
                                      act_scale_ub=self.act_scale_ub).chunk(2, dim=-1)
            out = fp8_grouped_mm(self.act(gate) * up, self.w2, self.w2_scale, offs,
                                 act_scale_ub=self.act_scale_ub)
            return out.view(num_experts, tokens, hidden)
        gate, up = torch.bmm(x_per_expert, self.w13.transpose(1, 2)).chunk(2, dim=-1)
        return torch.bmm(self.act(gate) * up, self.w2.transpose(1, 2))


class MoE(nn.Module):
    #: Up to this many tokens every expert runs on every token (scores of the
    #: unchosen experts are 0, so their inputs and outputs are exactly 0): no
    #: data-dependent shapes, so decode steps can be captured in a CUDA graph.
    DENSE_MAX_TOKENS = 64

    def __init__(self, config, fp8: Fp8Plan = NO_FP8, prefix: str = "feed_forward"):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_local_experts
        act = activation(config)
        hidden, inner = config.hidden_size, config.intermediate_size
        self.experts = Experts(self.num_experts, hidden, inner, act,
                               f"{prefix}.experts" in fp8.modules, fp8.act_scale_ub)
        self.router = fp8.linear(f"{prefix}.router", hidden, self.num_experts)
        self.shared_expert = GatedMLP(hidden, inner, act, fp8, f"{prefix}.shared_expert")

    def forward(self, x):
        logits = self.router(x)
        top_logit, top_index = torch.topk(logits, self.top_k, dim=1)
        top_score = torch.sigmoid(top_logit.float()).to(x.dtype)
        out = self.shared_expert(x)
        if x.shape[0] <= self.DENSE_MAX_TOKENS or (
                x.is_cuda and torch.cuda.is_current_stream_capturing()):
            scores = torch.zeros_like(logits).scatter_(1, top_index, top_score)
            routed = self.experts.run_all(scores.t().unsqueeze(-1) * x.unsqueeze(0))
            return out + routed.sum(0)
        # Long batches: each expert runs only on its own tokens.  One stable sort
        # groups the (token, expert) pairs by expert; one .tolist() of the counts
        # is the layer's only host sync (not one per expert).
        flat_expert = top_index.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        rows_sorted = torch.div(order, self.top_k, rounding_mode="floor")
        scores_sorted = top_score.reshape(-1, 1)[order]
        counts = torch.bincount(flat_expert, minlength=self.num_experts).tolist()
        pieces = zip(rows_sorted.split(counts), scores_sorted.split(counts), strict=True)
        for expert, (rows, scores) in enumerate(pieces):
            if counts[expert]:
                out.index_add_(0, rows, self.experts.run(expert, x[rows] * scores))
        return out


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int, fp8: Fp8Plan = NO_FP8, prefix: str = "self_attn"):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        self.use_rope = bool(config.no_rope_layers[layer_idx])
        self.kind = layer_kind(config, layer_idx)
        self.qk_norm_eps = config.rms_norm_eps if (config.use_qk_norm and self.use_rope) else None
        self.temperature = None
        if config.attn_temperature_tuning and not self.use_rope:
            self.temperature = (float(config.floor_scale), float(config.attn_scale))
        bias = config.attention_bias
        hidden, hd = config.hidden_size, self.head_dim
        self.q_proj = fp8.linear(f"{prefix}.q_proj", hidden, self.num_heads * hd, bias)
        self.k_proj = fp8.linear(f"{prefix}.k_proj", hidden, self.num_kv_heads * hd, bias)
        self.v_proj = fp8.linear(f"{prefix}.v_proj", hidden, self.num_kv_heads * hd, bias)
        self.o_proj = fp8.linear(f"{prefix}.o_proj", self.num_heads * hd, hidden, bias)
        # Paged caches [num_blocks, block_size, Hkv, D], bound by the model runner.
        self.k_cache = self.v_cache = None

    def forward(self, x, positions, freqs_cis, step: AttentionStep):
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            q, k = _rotate(q, freqs_cis), _rotate(k, freqs_cis)
        if self.qk_norm_eps is not None:
            q, k = _rms(q, self.qk_norm_eps), _rms(k, self.qk_norm_eps)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale))
            q = (q * (scales * attn_scale + 1.0).view(t, 1, 1)).to(q.dtype)
        # Keys and values go to the cache first: the step's queries read them
        # back through the block table like every earlier token's.
        flat_k = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, step.slot_mapping, k.to(flat_k.dtype))
        flat_v.index_copy_(0, step.slot_mapping, v.to(flat_v.dtype))
        out = step.backend.forward(step.metadata, q, self.k_cache, self.v_cache, self.scale,
                                   chunked=step.chunked)
        return self.o_proj(out.reshape(t, -1).to(x.dtype))


def _rotate(x, freqs_cis):
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs_cis[:, None, :]).flatten(-2).type_as(x)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, fp8: Fp8Plan = NO_FP8):
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        self.self_attn = Attention(config, layer_idx, fp8, f"{prefix}.self_attn")
        if layer_idx in config.moe_layers:
            self.feed_forward = MoE(config, fp8, f"{prefix}.feed_forward")
        else:
            self.feed_forward = GatedMLP(config.hidden_size, config.intermediate_size_mlp,
                                         activation(config), fp8, f"{prefix}.feed_forward")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, positions, freqs_cis, steps):
        step = steps[self.self_attn.kind]
        x = x + self.self_attn(self.input_layernorm(x), positions, freqs_cis, step)
        return x + self.feed_forward(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    def __init__(self, config, fp8: Fp8Plan = NO_FP8):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, fp8) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Llama4ForCausalLM(nn.Module):
    """Module names follow the text checkpoint's (``model.layers.N...``, ``lm_head``); the
    routed experts hold (N, K) matrices (``w13``/``w2``, see :class:`Experts`) that the
    loader (models/loader.py) assembles from either published expert layout."""

    def __init__(self, config, fp8: Fp8Plan = NO_FP8):
        super().__init__()
        self.config = config
        self.model = TextModel(config, fp8)
        self.lm_head = fp8.linear("lm_head", config.hidden_size, config.vocab_size)
        self._inv_freq = None
        self._rope_scaling = 1.0

    @property
    def layers(self):
        return self.model.layers

    def init_rope(self, device):
        """float32 inverse frequencies on ``device`` (transformers' formulas per rope type)."""
        params = rope_parameters(self.config)
        rope_type = supported_rope_type(self.config)
        if rope_type == "default":
            dim = self.config.head_dim
            exponents = torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim
            self._inv_freq = 1.0 / (params.get("rope_theta", 500000.0) ** exponents)
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self._rope_scaling = ROPE_INIT_FUNCTIONS[rope_type](self.config, device)
            self._inv_freq = inv_freq.float().to(device)

    def forward(self, input_ids, positions, steps: dict[str, AttentionStep]):
        """input_ids, positions: [tokens]; returns final-normed hidden states [tokens, H]."""
        angles = positions.float()[:, None] * self._inv_freq[None, :]
        freqs_cis = torch.polar(torch.ones_like(angles), angles) * self._rope_scaling
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, freqs_cis, steps)
        return self.model.norm(x)

    def compute_logits(self, hidden):
        return self.lm_head(hidden)
