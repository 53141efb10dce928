"""Tiny Llama-4 checkpoints laid out as the published Scout and Maverick ones, and oracles.

Weights come from transformers' own ``Llama4ForCausalLM`` (random, seeded); the files
are written the way the published repositories hold them, not the way this library
reads them:

- config.json as published: legacy ``rope_scaling`` + ``rope_theta``,
  ``attn_temperature_tuning: 4``, ``torch_dtype``, explicit ``moe_layers`` and
  ``no_rope_layers``, an EOS list, ``for_llm_compressor``, ``cache_implementation``;
  multimodal ones nest it as ``text_config`` beside a ``vision_config``.
- weights in shards with ``model.safetensors.index.json`` (multimodal: text tensors under
  ``language_model.``, plus vision tensors), generation_config.json, optionally a stray
  ``*.safetensors`` file holding a tensor of the same name.
- FP8: compressed-tensors FP8-dynamic made by the ``compressed-tensors`` package itself
  (experts as one Linear per expert, as llm-compressor writes Llama-4), and fbgemm_fp8
  with the parameter names and shapes of transformers' fbgemm_fp8 integration.

The FP8 oracle is transformers' float32 model with the dequantized weights and every
quantized layer's input fake-quantized per token: the math the FP8 kernels do.
"""

from __future__ import annotations

import contextlib
import copy
import json

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F

SCOUT = dict(  # Llama-4-Scout-17B-16E-Instruct's text_config, shrunk (sizes only)
    attention_bias=False, attention_chunk_size=32, attention_dropout=0.0, attn_scale=0.5,
    attn_temperature_tuning=4, bos_token_id=500, cache_implementation="hybrid",
    eos_token_id=[501, 502, 503], floor_scale=16, for_llm_compressor=False, head_dim=16,
    hidden_act="silu", hidden_size=64, initializer_range=0.1, interleave_moe_layer_step=1,
    intermediate_size=64, intermediate_size_mlp=96, max_position_embeddings=1024,
    model_type="llama4_text", moe_layers=[0, 1, 2, 3], no_rope_layers=[1, 1, 1, 0],
    num_attention_heads=4, num_experts_per_tok=1, num_hidden_layers=4, num_key_value_heads=2,
    num_local_experts=4, output_router_logits=False, pad_token_id=504, rms_norm_eps=1e-05,
    rope_scaling={"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 64, "rope_type": "llama3"},
    rope_theta=500000.0, router_aux_loss_coef=0.001, router_jitter_noise=0.0,
    torch_dtype="float32", use_cache=True, use_qk_norm=True, vocab_size=512)
# Llama-4-Maverick-17B-128E's text_config, shrunk: MoE every other layer, no qk norm, plain
# RoPE (rope_scaling null), no attn_temperature_tuning key (transformers' default: on)
MAVERICK = dict(SCOUT, interleave_moe_layer_step=2, moe_layers=[1, 3], num_local_experts=8,
                rope_scaling=None, use_qk_norm=False)
del MAVERICK["attn_temperature_tuning"]
VISION = dict(hidden_size=32, image_size=8, patch_size=4, num_hidden_layers=1,
              num_attention_heads=2, intermediate_size=64, model_type="llama4_vision_model",
              vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
# the ignore list of llm-compressor's Llama-4 FP8 example (examples/quantization_w8a8_fp8)
IGNORE_CT = ["re:.*lm_head", "re:.*self_attn", "re:.*router", "re:.*vision_model.*",
             "re:.*multi_modal_projector.*", "Llama4TextAttention"]


def hf_model(text: dict, seed: int = 0):
    """transformers' float32 Llama4ForCausalLM for a published text_config (transformers'
    own reading of it; ``attn_temperature_tuning: 4`` means on)."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    values = {k: v for k, v in text.items() if k not in ("torch_dtype", "model_type")}
    values["attn_temperature_tuning"] = bool(text.get("attn_temperature_tuning", True))
    config = Llama4TextConfig(**values)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return Llama4ForCausalLM(config).eval()


def write_published(path, text: dict, tensors: dict, *, multimodal=False, shards=3,
                    generation_eos=None, quantization_config=None, stray=False,
                    index=True):
    """Write ``tensors`` (text-model names) and config.json as a published repository."""
    path.mkdir(parents=True, exist_ok=True)
    if multimodal:
        tensors = {"language_model." + k: v for k, v in tensors.items()}
        gen = torch.Generator().manual_seed(7)
        tensors["vision_model.patch_embedding.linear.weight"] = torch.randn(32, 48, generator=gen)
        tensors["multi_modal_projector.linear_1.weight"] = torch.randn(64, 32, generator=gen)
        config = {"architectures": ["Llama4ForConditionalGeneration"], "boi_token_index": 505,
                  "eoi_token_index": 506, "image_token_index": 507, "model_type": "llama4",
                  "text_config": text, "tie_word_embeddings": False,
                  "torch_dtype": text["torch_dtype"], "transformers_version": "4.51.0.dev0",
                  "vision_config": VISION}
    else:
        config = {"architectures": ["Llama4ForCausalLM"], **text, "tie_word_embeddings": False,
                  "transformers_version": "4.51.0.dev0"}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config, indent=2))
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    if index:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (path / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": 500, "do_sample": True, "eos_token_id": generation_eos,
             "pad_token_id": 504, "temperature": 0.6, "top_p": 0.9,
             "transformers_version": "4.51.0.dev0"}))
    if stray:  # e.g. a leftover consolidated file: same tensor names, other values
        victim = names[0]
        save_file({victim: torch.zeros_like(tensors[victim])},
                  str(path / "consolidated.safetensors"))
    return path


def read_tensors(path) -> dict:
    """Every tensor of a checkpoint's indexed files (test-side reader), text names."""
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, file in weight_map.items():
        with safe_open(str(path / file), "pt") as f:
            out[name.removeprefix("language_model.")] = f.get_tensor(name)
    return out


@torch.inference_mode()
def hf_generate(model, prompt, max_new_tokens, eos=None):
    """transformers' greedy tokens, stopping at ``eos`` (a list) when given."""
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = (eos or [0])[0]
    kwargs = {} if eos else {"min_new_tokens": max_new_tokens}
    ids = torch.tensor([prompt], device=model.device)
    # An explicit mask: without one, generate() takes every prompt token equal to the pad
    # id (eos[0], or 0) for padding and hides it from attention.  No KV cache: every step is
    # the model's full forward (its definition).  transformers 5.25's cached Llama-4 decode
    # ("hybrid" cache) moved a token's logits by 0.03 at position 91 of a 32-token-chunk
    # model, where its own full forward, and ours, agree to 1e-6 (the FP8 Scout tests
    # failed on it on 2026-12-06, on code that had passed the day before).
    out = model.generate(ids, attention_mask=torch.ones_like(ids), use_cache=False,
                         max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


# -- FP8 ------------------------------------------------------------------------------------

def fake_quant(x: torch.Tensor, scale_ub=None) -> torch.Tensor:
    """Per-token (row) e4m3 quantize-dequantize: scale = amax / 448."""
    amax = x.float().abs().amax(-1, keepdim=True)
    if scale_ub is not None:
        amax = amax.clamp(max=scale_ub)
    # divided by a tensor: CUDA would multiply by float32(1/448) instead (1 ulp off)
    scale = amax.clamp(min=1e-12) / amax.new_full((), 448.0)
    q = (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def quantize_rows(w: torch.Tensor):
    """Per-row (output channel) e4m3 weights and float32 scales [N, 1]."""
    scale = w.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


class _Expert(nn.Module):
    def __init__(self, hidden, inner):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)


def compressed_tensors_fp8(hf) -> tuple[dict, dict]:
    """(tensors, quantization_config) of ``hf`` compressed by the compressed-tensors package
    with its FP8_DYNAMIC preset, the published Llama-4 recipe's ignore list, and the experts
    split into one Linear per expert as llm-compressor does (weights as its
    copy_from_experts_module takes them from the fused, transposed experts)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = copy.deepcopy(hf)
    for layer in model.model.layers:
        experts = getattr(layer.feed_forward, "experts", None)
        if experts is None:
            continue
        inner = experts.expert_dim
        linear = nn.ModuleList(_Expert(experts.hidden_size, inner)
                               for _ in range(experts.num_experts))
        with torch.no_grad():
            for e, mod in enumerate(linear):
                mod.gate_proj.weight.copy_(experts.gate_up_proj[e, :, :inner].T)
                mod.up_proj.weight.copy_(experts.gate_up_proj[e, :, inner:].T)
                mod.down_proj.weight.copy_(experts.down_proj[e].T)
        layer.feed_forward.experts = linear
    qconfig = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])},
        ignore=IGNORE_CT)
    apply_quantization_config(model, qconfig, show_progress=False)
    with torch.no_grad():  # the minmax observer of llm-compressor, per output channel
        for module in model.modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is not None:
                w = module.weight
                scale, _ = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True),
                                             scheme.weights)
                module.weight_scale.copy_(scale)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    qc = compressor.quantization_config.model_dump(exclude=["quant_method"])
    qc = json.loads(json.dumps({"quant_method": "compressed-tensors", **qc}, default=str))
    return tensors, qc


def fbgemm_fp8(hf, skip: list[str]) -> dict:
    """Tensors of ``hf`` quantized as transformers' fbgemm_fp8 integration stores them:
    Linear ``weight`` [out, in] e4m3 + ``weight_scale`` [out, 1]; experts ``gate_up_proj``
    [E, H, 2I] + ``gate_up_proj_scale`` [E, 1, 2I], ``down_proj`` [E, I, H] +
    ``down_proj_scale`` [E, H, 1] (per output channel).  ``skip``: module names kept
    16-bit (modules_to_not_convert, as substrings)."""
    tensors = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    for name, module in hf.named_modules():
        if any(s in name for s in skip):
            continue
        if type(module).__name__ == "Llama4TextExperts":
            for which in ("gate_up_proj", "down_proj"):
                w = getattr(module, which).detach().transpose(1, 2)  # [E, out, in]
                q, scale = quantize_rows(w.reshape(-1, w.shape[-1]))
                tensors[f"{name}.{which}"] = q.reshape(w.shape).transpose(1, 2)
                scale = scale.reshape(w.shape[0], w.shape[1])
                tensors[f"{name}.{which}_scale"] = (scale[:, None, :] if which == "gate_up_proj"
                                                    else scale[:, :, None])
        elif isinstance(module, nn.Linear):
            q, scale = quantize_rows(module.weight.detach())
            tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = q, scale
    return tensors


def write_maverick_fbgemm(path, hf):
    """A 4-layer Maverick-shaped checkpoint as meta-llama's Maverick FP8 ships: fbgemm_fp8,
    activation_scale_ub 1200, attention, routers, lm_head and vision left 16-bit."""
    skip = ["self_attn", "router", "lm_head"]
    return write_published(path, MAVERICK, fbgemm_fp8(hf, skip), multimodal=True,
                           quantization_config={
                               "activation_scale_ub": 1200.0, "quant_method": "fbgemm_fp8",
                               "modules_to_not_convert": [
                                   f"language_model.model.layers.{i}.{m}" for i in range(4)
                                   for m in ("self_attn", "feed_forward.router")]
                               + ["language_model.lm_head", "vision_model",
                                  "multi_modal_projector"]})


def fp8_oracle(hf, tensors: dict, scale_ub=None):
    """``hf`` with the dequantized weights of ``tensors`` and per-token fake-quantized inputs
    to every FP8 layer (both expert layouts)."""
    model = copy.deepcopy(hf)

    def deq(name):
        return tensors[name].float() * tensors[name + "_scale"].float().reshape(-1, 1)

    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and f"{name}.weight_scale" in tensors:
                module.weight.copy_(deq(f"{name}.weight"))
                module.register_forward_pre_hook(
                    lambda _m, args: (fake_quant(args[0], scale_ub),))
            elif type(module).__name__ == "Llama4TextExperts":
                gate_up, down = module.gate_up_proj, module.down_proj
                if f"{name}.gate_up_proj_scale" in tensors:
                    gate_up.copy_(tensors[f"{name}.gate_up_proj"].float()
                                  * tensors[f"{name}.gate_up_proj_scale"])
                    down.copy_(tensors[f"{name}.down_proj"].float()
                               * tensors[f"{name}.down_proj_scale"].transpose(1, 2))
                elif f"{name}.0.gate_proj.weight_scale" in tensors:
                    for e in range(gate_up.shape[0]):
                        gate_up[e].copy_(torch.cat([deq(f"{name}.{e}.gate_proj.weight"),
                                                    deq(f"{name}.{e}.up_proj.weight")]).T)
                        down[e].copy_(deq(f"{name}.{e}.down_proj.weight").T)
                else:
                    continue
                module.forward = _fake_quant_experts(module, scale_ub)
    return model


def _fake_quant_experts(module, scale_ub):
    """transformers' Llama4TextExperts.forward with the two matmul inputs fake-quantized."""
    def forward(hidden_states):
        x = hidden_states.view(module.gate_up_proj.shape[0], -1, module.hidden_size)
        gate, up = torch.bmm(fake_quant(x, scale_ub), module.gate_up_proj).chunk(2, dim=-1)
        out = torch.bmm(fake_quant(up * module.act_fn(gate), scale_ub), module.down_proj)
        return out.view(-1, module.hidden_size)
    return forward


# -- routing: where the engine and an oracle chose different experts -----------------------

@contextlib.contextmanager
def routing_trace(model: nn.Module):
    """Collects, while open, the router logits of every MoE layer of ``model`` (transformers'
    or this library's: a Linear named ``*.router``), recomputed from each call's input in the
    router's own dtype.  Yields ``{layer name: [[T, E] float32 per call]}``, layers in model
    order; graph replays call no hook, so only eager forwards are seen.  The in-kernel router
    (``route_triton.ROUTER_IN_KERNEL``) calls no router module either, so it is off while the
    trace is open (the logits are recomputed from the router's input in both cases)."""
    from chunklocal.models import route_triton

    calls: dict[str, list[torch.Tensor]] = {}

    def hook(name):
        def record(module, args):
            x = args[0].reshape(-1, module.weight.shape[1])
            calls[name].append(F.linear(x, module.weight).float())
        return record

    handles = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "router" and isinstance(module, nn.Linear):
            calls[name] = []
            handles.append(module.register_forward_pre_hook(hook(name)))
    if not handles:
        raise ValueError(f"{type(model).__name__} has no Linear named '*.router'")
    in_kernel, route_triton.ROUTER_IN_KERNEL = route_triton.ROUTER_IN_KERNEL, False
    try:
        yield calls
    finally:
        route_triton.ROUTER_IN_KERNEL = in_kernel
        for handle in handles:
            handle.remove()


def routing_logits(trace: dict, tokens: int) -> list[torch.Tensor]:
    """Per MoE layer, the logits of the first ``tokens`` rows routed (calls in order: a
    prompt's positions, however many steps its prefill took)."""
    out = []
    for name, calls in trace.items():
        rows = torch.cat(calls) if calls else torch.empty(0)
        if rows.shape[0] < tokens:
            raise ValueError(f"{name} routed {rows.shape[0]} rows, fewer than the {tokens} "
                             "asked for (a graph replay hides its calls)")
        out.append(rows[:tokens].cpu())
    return out


def routing_flips(want: list[torch.Tensor], got: list[torch.Tensor], top_k: int):
    """(flipped [T] bool, closeness [T] float) of two runs' router logits (``routing_logits``,
    same layers and tokens): ``flipped`` where some layer chose a different set of ``top_k``
    experts in ``got`` than in ``want``; ``closeness`` is, over those layers, the smallest
    ``want`` margin (k-th minus (k+1)-th logit) divided by that layer's median margin (inf
    where nothing flipped).  Rounding can only flip near-ties, so real flips have small
    closeness; a wrong router flips tokens at any margin."""
    if len(want) != len(got) or any(a.shape != b.shape for a, b in zip(want, got, strict=False)):
        raise ValueError(f"routing of different shapes: {[tuple(a.shape) for a in want]} "
                         f"against {[tuple(b.shape) for b in got]}")
    flipped = torch.zeros(want[0].shape[0], dtype=torch.bool)
    closeness = torch.full(flipped.shape, float("inf"))
    for a, b in zip(want, got, strict=True):
        differ = (a.topk(top_k, dim=-1).indices.sort(-1).values
                  != b.topk(top_k, dim=-1).indices.sort(-1).values).any(-1)
        flipped |= differ
        closeness = torch.where(differ, torch.minimum(closeness, relative_margin(a, top_k)),
                                closeness)
    return flipped, closeness


def relative_margin(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T]: each token's margin between its k-th and (k+1)-th router logit (``logits [T,
    E]``) over the layer's median margin: how near a tie its routing is."""
    top = logits.topk(top_k + 1, dim=-1).values
    margin = top[:, top_k - 1] - top[:, top_k]
    return margin / margin.median().clamp_min(torch.finfo(margin.dtype).tiny)
