"""Llama-4 text model over flat token batches and a paged KV cache.

Layers see ``[tokens, hidden]`` with one absolute position per token; requests
are told apart only by the attention metadata.  RoPE layers attend chunk-locally
(``Kind.CHUNKED``), NoPE layers globally (``Kind.GLOBAL``); each kind gets one
backend metadata object per step (:class:`chunklocal.backends.base.AttentionStep`).

Numerics follow transformers' ``Llama4ForCausalLM``: RoPE as a complex product
over interleaved pairs ``(x[2i], x[2i+1])`` in float32, L2 qk-norm after RoPE on
RoPE layers only, temperature tuning of the queries on NoPE layers, a top-k
router whose sigmoid scores scale the expert *inputs*, a shared expert (both in
models/moe.py), and the dense MLP width ``intermediate_size_mlp`` on non-MoE layers.
"""

from __future__ import annotations

import torch
from torch import nn

from chunklocal.backends.base import AttentionStep, Kind
from chunklocal.kv_quant import calibrated_scales, is_fp8, write_fp8
from chunklocal.kv_spec import softmax_scale
from chunklocal.models.fused import GatedMLPBase, fuse_into
from chunklocal.models.gemv_triton import linear
from chunklocal.models.kv_write_triton import (
    kv_write_16bit_available,
    kv_write_available,
    write_kv,
    write_kv_fp8,
)
from chunklocal.models.llama4_config import (  # noqa: F401  (load_text_config: re-exported)
    activation,
    layer_kind,
    load_text_config,
    rope_parameters,
    supported_rope_type,
)
from chunklocal.models.moe import MoE
from chunklocal.models.parallel import (
    SINGLE,
    TPGroup,
    column_parallel,
    row_parallel,
    vocab_embedding,
)
from chunklocal.models.quant import FP8, NO_FP8, Fp8Linear, Fp8Plan
from chunklocal.models.sharding import kv_head_split


def _maker(fp8: Fp8Plan, name: str):
    """``make(in, out, bias)`` for the parallel layer helpers: FP8 where ``fp8`` says so."""
    return lambda in_features, out_features, bias: fp8.linear(name, in_features, out_features,
                                                              bias)


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


def add_rms_norm(h: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm):
    """(``norm(s)``, ``s``) for the residual stream ``s = residual + h`` (``h`` itself when
    ``residual`` is None: the embeddings).  One Triton kernel where models/norm_triton.py
    is switched on and runs; torch's add and ``RMSNorm`` otherwise (the same arithmetic)."""
    import chunklocal.models.norm_triton as norm_triton

    if norm_triton.norm_available(h):  # the switch is part of the check
        return norm_triton.add_rms_norm_rows(h, residual, norm.weight, norm.eps)
    total = h if residual is None else residual + h
    return norm(total), total


class GatedMLP(GatedMLPBase):
    """Dense MLP; tensor parallel: this rank's slice of the inner size, one all-reduce."""

    def __init__(self, hidden: int, inner: int, act: nn.Module, fp8: Fp8Plan = NO_FP8,
                 prefix: str = "", tp: TPGroup = SINGLE):
        super().__init__()
        self.act, self.tp = act, tp
        self.gate_proj = column_parallel(hidden, inner, False, tp,
                                         make=_maker(fp8, f"{prefix}.gate_proj"))
        self.up_proj = column_parallel(hidden, inner, False, tp,
                                       make=_maker(fp8, f"{prefix}.up_proj"))
        self.down_proj = row_parallel(inner, hidden, False, tp,
                                      make=_maker(fp8, f"{prefix}.down_proj"))

    def forward(self, x):
        out = self.down_proj(self.gated(x))
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


class Attention(nn.Module):
    """This rank's query heads (num_attention_heads / N) and the KV heads they read."""

    def __init__(self, config, layer_idx: int, fp8: Fp8Plan = NO_FP8, prefix: str = "self_attn",
                 tp: TPGroup = SINGLE):
        super().__init__()
        self.num_heads = config.num_attention_heads // tp.size
        self.num_kv_heads, kv_replicas = kv_head_split(config.num_key_value_heads, tp.size)
        self.head_dim = config.head_dim
        self.scale = softmax_scale(self.head_dim)
        self.use_rope = bool(config.no_rope_layers[layer_idx])
        self.kind = layer_kind(config, layer_idx)
        self.qk_norm_eps = config.rms_norm_eps if (config.use_qk_norm and self.use_rope) else None
        # NoPE layers scale their queries by the step's query_temperature
        self.temperature_tuning = bool(config.attn_temperature_tuning) and not self.use_rope
        bias = config.attention_bias
        hidden, hd = config.hidden_size, self.head_dim
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.tp = tp
        self.q_proj = column_parallel(hidden, heads * hd, bias, tp,
                                      make=_maker(fp8, f"{prefix}.q_proj"))
        self.k_proj = column_parallel(hidden, kv_heads * hd, bias, tp, kv_replicas,
                                      make=_maker(fp8, f"{prefix}.k_proj"))
        self.v_proj = column_parallel(hidden, kv_heads * hd, bias, tp, kv_replicas,
                                      make=_maker(fp8, f"{prefix}.v_proj"))
        self.o_proj = row_parallel(heads * hd, hidden, bias, tp,
                                   make=_maker(fp8, f"{prefix}.o_proj"))
        self.qkv_proj: nn.Module | None = None  # set by fuse(): q, k, v in one GEMM
        self.qkv_sizes: list[int] = []
        # Paged caches [num_blocks, block_size, Hkv, D], bound by the model runner.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # Dequantization scales of FP8 pages (kv_cache_dtype="fp8"; chunklocal/kv_quant.py).
        self.k_scale, self.v_scale = 1.0, 1.0
        self.calibrate_kv = False  # set for one step: scales from that step's K and V

    def fuse(self) -> bool:
        """q_proj, k_proj and v_proj as one ``qkv_proj`` (models/fused.py)."""
        if self.qkv_proj is not None:  # fused already
            return False
        sizes = fuse_into(self, ("q_proj", "k_proj", "v_proj"), "qkv_proj")
        self.qkv_sizes = sizes or []
        return sizes is not None

    def forward(self, x, q_scale, freqs_cis, step: AttentionStep):
        """``q_scale``: the step's query temperature per token (:func:`query_temperature`),
        the same for every NoPE layer, so computed once per step."""
        q, k, v = self.project(x, q_scale, freqs_cis)
        return self.output(self.attend(q, k, v, step), x.dtype)

    def project(self, x, q_scale, freqs_cis):
        """Queries, keys and values of ``x [T, hidden]``: ``[T, heads, head_dim]`` each, rope,
        QK norm and temperature applied.  Row by row: what a piecewise graph captures
        (engine/piecewise_graphs.py) before the attention."""
        t = x.shape[0]
        if self.qkv_proj is not None:
            q, k, v = linear(self.qkv_proj, x).split(self.qkv_sizes, dim=-1)
        else:
            q, k, v = linear(self.q_proj, x), linear(self.k_proj, x), linear(self.v_proj, x)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.use_rope:  # Llama-4's QK norm is on rope layers only
            q, k = rope_qk(q, k, freqs_cis, self.qk_norm_eps)
        if self.temperature_tuning:
            # In place, one kernel: the product in float32 (q_scale's dtype), rounded once
            # to q's -- the bits of ``(q * q_scale).to(q.dtype)``, which wrote a float32
            # [T, heads, head_dim] and cast it back (two passes over 3x q's bytes; a 12-layer
            # 8k prefill step of Scout FP8 spent about 1 ms there, 30th session's profile).
            # q is a slice of the step's fresh projection, read by nothing else.
            q = q.mul_(q_scale)
        return q, k, v

    def attend(self, q, k, v, step: AttentionStep):
        """The step's attention: K and V written to the cache, the backend's output
        ``[T, heads, head_dim]``.  The only part of a layer that reads the step's request
        layout (its metadata), so piecewise graphs run it eagerly between segments."""
        # Keys and values go to the cache first: the step's queries read them
        # back through the block table like every earlier token's.
        k_cache, v_cache = self.k_cache, self.v_cache
        if k_cache is None or v_cache is None:
            raise RuntimeError("Attention.forward: no KV cache bound (the model runner binds "
                               "one before the first forward)")
        flat_k = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        if is_fp8(k_cache):  # quantized here, dequantized by the backend
            if self.calibrate_kv:  # calculate_kv_scales: before the first page is written
                self.k_scale, self.v_scale = calibrated_scales(k, v)
                self.calibrate_kv = False
            if kv_write_available(k, v):  # one launch for both (the switch is checked)
                write_kv_fp8(flat_k, flat_v, step.slot_mapping, k, v, self.k_scale,
                             self.v_scale)
            else:
                write_fp8(flat_k, step.slot_mapping, k, self.k_scale)
                write_fp8(flat_v, step.slot_mapping, v, self.v_scale)
            out = step.backend.forward(step.metadata, q, k_cache, v_cache, self.scale,
                                       kind=step.kind, k_scale=self.k_scale,
                                       v_scale=self.v_scale)
        else:
            if kv_write_16bit_available(k, v):  # its switch and the rows (on the CPU: no)
                write_kv(flat_k, flat_v, step.slot_mapping, k, v)
            else:
                flat_k.index_copy_(0, step.slot_mapping, k.to(flat_k.dtype))
                flat_v.index_copy_(0, step.slot_mapping, v.to(flat_v.dtype))
            out = step.backend.forward(step.metadata, q, k_cache, v_cache, self.scale,
                                       kind=step.kind, k=k, v=v)
        return out

    def output(self, out, dtype):
        """o_proj of the attention's output ``[T, heads, head_dim]`` (or ``[T, heads *
        head_dim]``), summed over the tensor-parallel ranks."""
        out = linear(self.o_proj, out.reshape(out.shape[0], -1).to(dtype))
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


def query_temperature(config, positions: torch.Tensor) -> torch.Tensor | None:
    """Llama-4's attention temperature of the NoPE layers' queries, float32 ``[T, 1, 1]``
    (None without ``attn_temperature_tuning``)."""
    if not config.attn_temperature_tuning:
        return None
    floor_scale, attn_scale = float(config.floor_scale), float(config.attn_scale)
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale))
    return (scales * attn_scale + 1.0).view(-1, 1, 1)


def _rotate(x, freqs_cis):
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs_cis[:, None, :]).flatten(-2).type_as(x)


def rope_heads(x: torch.Tensor, freqs_cis: torch.Tensor, qk_norm_eps: float | None):
    """Heads ``x [T, H, D]`` rotated (``_rotate``), then normalized (``_rms``) when
    ``qk_norm_eps`` is given: one Triton kernel where models/norm_triton.py is switched on
    and runs, torch's ops otherwise."""
    import chunklocal.models.norm_triton as norm_triton

    if norm_triton.rope_available(x):
        return norm_triton.rope_norm_rows(x, freqs_cis, qk_norm_eps)
    x = _rotate(x, freqs_cis)
    return x if qk_norm_eps is None else _rms(x, qk_norm_eps)


def rope_qk(q: torch.Tensor, k: torch.Tensor, freqs_cis: torch.Tensor,
            qk_norm_eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_heads` of the queries and the keys; one Triton launch for both where ``k``'s
    heads follow ``q``'s in memory (the fused ``qkv_proj``'s output), two otherwise."""
    import chunklocal.models.norm_triton as norm_triton

    t, hq, d = q.shape
    # with one token the token stride means nothing (reshape may give the views different ones)
    if (norm_triton.rope_available(q) and k.dim() == 3 and k.shape[0] == t
            and k.shape[2] == d and k.stride()[1:] == q.stride()[1:]
            and (t == 1 or k.stride(0) == q.stride(0)) and k.dtype == q.dtype
            and k.data_ptr() == q.data_ptr() + hq * q.stride(1) * q.element_size()):
        both = q.as_strided((t, hq + k.shape[1], d), q.stride())
        return norm_triton.rope_norm_rows(both, freqs_cis, qk_norm_eps, split=hq)
    return rope_heads(q, freqs_cis, qk_norm_eps), rope_heads(k, freqs_cis, qk_norm_eps)


def fp8_moe(moe: MoE, fp8: Fp8Plan, prefix: str) -> MoE:
    """Make the parts of a MoE layer that ``fp8`` names FP8: the routed experts (float8
    ``w13``/``w2`` with float32 per-output-channel scale buffers ``[E, N]``, as
    models/moe.py takes them), the shared expert's and the router's Linear layers."""
    ex = moe.experts
    if f"{prefix}.experts" in fp8.modules:
        for name in ("w13", "w2"):
            shape = getattr(ex, name).shape
            setattr(ex, name, nn.Parameter(torch.empty(shape, dtype=FP8), requires_grad=False))
            setattr(ex, name + "_scale", torch.empty(shape[:2], dtype=torch.float32))
        ex.act_scale_ub = fp8.act_scale_ub
    for owner, names in ((moe.shared_expert, ("gate_proj", "up_proj", "down_proj")),
                         (moe, ("router",))):
        for name in names:
            if f"{prefix}.{'shared_expert.' if owner is not moe else ''}{name}" in fp8.modules:
                old = getattr(owner, name)
                new = Fp8Linear(old.in_features, old.out_features, False, fp8.act_scale_ub)
                if hasattr(old, "shard_rules"):  # a tensor-parallel slice stays one
                    new.shard_rules = old.shard_rules
                    new.amax_reduce = moe.tp.all_reduce_max if name == "down_proj" else None
                setattr(owner, name, new)
    return moe


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, fp8: Fp8Plan = NO_FP8, tp: TPGroup = SINGLE):
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        self.self_attn = Attention(config, layer_idx, fp8, f"{prefix}.self_attn", tp)
        if layer_idx in config.moe_layers:
            self.feed_forward = fp8_moe(MoE.from_config(config, activation(config), tp=tp), fp8,
                                        f"{prefix}.feed_forward")
        else:
            self.feed_forward = GatedMLP(config.hidden_size, config.intermediate_size_mlp,
                                         activation(config), fp8, f"{prefix}.feed_forward", tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, state: list, q_scale, freqs_cis, steps) -> None:
        """``state = [h, residual]``, replaced in place by this layer's: ``h`` is the previous
        sublayer's output not yet added to the residual stream ``residual`` (None before the
        first layer, where ``h`` is the embeddings; each add meets the next norm in
        :func:`add_rms_norm`).  A list, and ``del`` after each stage, because arguments stay
        referenced by the caller for the whole call: ``layer(h, residual)`` kept its inputs,
        q/k/v and the attention's output alive through the feed-forward, where the memory
        profile's reserved peak falls (benchmarks/activation_peak.py).  Piecewise graphs
        run the same tail through :meth:`after_attention`."""
        h, residual = state
        state.clear()
        q, k, v, residual = self.before_attention(h, residual, q_scale, freqs_cis)
        del h
        out = self.self_attn.attend(q, k, v, steps[self.self_attn.kind])
        del q, k, v
        h = self.self_attn.output(out, residual.dtype)
        del out
        normed, residual = add_rms_norm(h, residual, self.post_attention_layernorm)
        del h
        state[:] = self.feed_forward(normed), residual

    def before_attention(self, h, residual, q_scale, freqs_cis):
        """The input norm and the attention's projections: ``(q, k, v, residual)``."""
        normed, residual = add_rms_norm(h, residual, self.input_layernorm)
        q, k, v = self.self_attn.project(normed, q_scale, freqs_cis)
        return q, k, v, residual

    def after_attention(self, out, residual):
        """o_proj, the norm and the feed-forward: ``(h, residual)`` as :meth:`forward`."""
        normed, residual = add_rms_norm(self.self_attn.output(out, residual.dtype), residual,
                                        self.post_attention_layernorm)  # o_proj's out freed
        return self.feed_forward(normed), residual


class TextModel(nn.Module):
    def __init__(self, config, fp8: Fp8Plan = NO_FP8, tp: TPGroup = SINGLE):
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, fp8, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Llama4ForCausalLM(nn.Module):
    """Module names follow the text checkpoint's (``model.layers.N...``, ``lm_head``); the
    routed experts hold (N, K) stacks (``w13``/``w2``, models/moe.py) that models/loader.py
    assembles from either published expert layout.  ``fp8`` names the modules whose
    weights are FP8 (models/quant.py).  ``tp``: this rank's tensor-parallel group; its
    modules then hold this rank's slices (models/parallel.py)."""

    def __init__(self, config, fp8: Fp8Plan = NO_FP8, tp: TPGroup = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = TextModel(config, fp8, tp)
        self.lm_head = column_parallel(config.hidden_size, config.vocab_size, False, tp,
                                       make=_maker(fp8, "lm_head"))
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

    def forward(self, input_ids, positions, steps: dict[Kind, AttentionStep]):
        """input_ids, positions: [tokens]; returns final-normed hidden states [tokens, H]."""
        freqs_cis, q_scale = self.rope_inputs(positions)
        state = [self.model.embed_tokens(input_ids), None]  # [h, residual]: DecoderLayer
        for layer in self.model.layers:
            layer(state, q_scale, freqs_cis, steps)
        h, residual = state
        return add_rms_norm(h, residual, self.model.norm)[0]

    def rope_inputs(self, positions):
        """The step's rope factors ``freqs_cis [T, head_dim / 2]`` (complex64) and the NoPE
        layers' query temperature (:func:`query_temperature`), shared by every layer."""
        angles = positions.float()[:, None] * self._inv_freq[None, :]
        freqs_cis = torch.polar(torch.ones_like(angles), angles) * self._rope_scaling
        return freqs_cis, query_temperature(self.config, positions)

    def compute_logits(self, hidden):
        logits = linear(self.lm_head, hidden)
        return self.tp.all_gather_last(logits) if self.tp.size > 1 else logits
