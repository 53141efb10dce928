"""Llama-4 checkpoint configs as published, read the same on every supported transformers.

``config.json`` is read as JSON and handed to the installed transformers'
``Llama4TextConfig`` (its defaults and derived fields: ``no_rope_layers``,
``moe_layers``, ``layer_types``), after two normalisations the published files need:

- ``attn_temperature_tuning: 4`` (Scout, Maverick): transformers only tests its truth,
  but 5.x refuses a non-bool; it becomes ``True``.
- RoPE: legacy ``rope_scaling`` + ``rope_theta`` (published) or ``rope_parameters``
  (written by transformers 5) is converted into the form the installed version reads,
  so neither is dropped silently (4.57 reads only the first, 5.x only the second).

Multimodal configs (``model_type: llama4``) serve their nested ``text_config``.  Every
field the model would not compute as transformers does, and every inconsistent size
(experts per token, head counts, layer lists), raises ValueError here, before any
weight is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from chunklocal.backends.base import Kind
from chunklocal.models.quant_config import Fp8Scheme, parse_quantization_config

if TYPE_CHECKING:
    from transformers import Llama4TextConfig

MIN_TRANSFORMERS = (4, 57)  # 4.51-4.56's Llama-4 attention is broken or inaccurate
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def require_hf() -> None:
    """Checkpoints are read with transformers and safetensors (the ``hf`` extra)."""
    try:
        import safetensors  # noqa: F401
        import transformers
    except ImportError as err:
        raise ImportError(f"serving a checkpoint needs transformers and safetensors ({err}); "
                          'install them with: pip install "chunklocal[hf]"') from err
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    if version < MIN_TRANSFORMERS:
        raise ImportError(f"transformers {transformers.__version__} is too old for Llama-4: "
                          f"install transformers>={'.'.join(map(str, MIN_TRANSFORMERS))}")


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


@dataclass
class CheckpointConfig:
    """What ``config.json`` says, checked: the text config and the serving facts around it."""

    text: Llama4TextConfig           # the installed transformers' own class
    dtype: torch.dtype | None        # torch_dtype / dtype of the checkpoint
    quant: Fp8Scheme | None          # served FP8 scheme, None when not quantized
    eos_token_ids: frozenset         # config.json's EOS ids (generation_config: see below)
    image_token_index: int | None    # multimodal: the token an image's features replace
    multimodal: bool


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path.parent}: no {what}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: unreadable {what} ({err})") from err


def _token_ids(value, where: str) -> list[int]:
    values = [] if value is None else [value] if not isinstance(value, list) else value
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"{where}: eos_token_id must be an int or a list of ints, "
                         f"got {value!r}")
    return list(values)


def generation_eos(model_dir) -> list[int]:
    """``eos_token_id`` of generation_config.json (int or list), [] without the file."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    gen = _read_json(path, "generation_config.json")
    return _token_ids(gen.get("eos_token_id") if isinstance(gen, dict) else None, str(path))


def _dtype(value, where):
    if value is None:
        return None
    dtype = getattr(torch, value, None) if isinstance(value, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{where}: torch_dtype {value!r} is not a torch float dtype")
    return dtype


def _rope(text: dict, where: str) -> dict:
    """One RoPE description {"rope_type", "rope_theta", ...} from either spelling."""
    params, scaling, theta = (text.get("rope_parameters"), text.get("rope_scaling"),
                              text.get("rope_theta"))
    for name, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{where}: {name} must be an object, got {value!r}")
    rope = dict(params or scaling or {})
    if params and scaling and {k: v for k, v in scaling.items() if k != "rope_theta"} != {
            k: v for k, v in params.items() if k != "rope_theta"}:
        raise ValueError(f"{where}: rope_parameters {params} and rope_scaling {scaling} "
                         "disagree")
    if theta is not None:
        if rope.get("rope_theta", theta) != theta:
            raise ValueError(f"{where}: rope_theta {theta} disagrees with "
                             f"rope_parameters' {rope['rope_theta']}")
        rope["rope_theta"] = theta
    rope.setdefault("rope_theta", 500000.0)  # Llama4TextConfig's default
    rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type") or "default"
    # dynamic and longrope rescale the frequencies with the running sequence length;
    # one table of frequencies for every request cannot reproduce that.
    if rope["rope_type"] not in _STATIC_ROPE:
        raise ValueError(f"unsupported rope_type {rope['rope_type']!r} in the config")
    partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor {partial} is not served (Llama-4 "
                         "rotates whole heads)")
    return rope


def _text_kwargs(text: dict, where: str) -> dict:
    """config.json's text fields in the form the installed transformers reads."""
    kwargs = {k: v for k, v in text.items() if k not in (
        "rope_parameters", "rope_scaling", "rope_theta", "quantization_config",
        "torch_dtype", "dtype", "model_type", "architectures", "transformers_version")}
    tuning = text.get("attn_temperature_tuning", True)
    if not isinstance(tuning, (bool, int)):
        raise ValueError(f"{where}: attn_temperature_tuning must be a bool or an int, "
                         f"got {tuning!r}")
    kwargs["attn_temperature_tuning"] = bool(tuning)  # published: 4, meaning on
    flags, layers = text.get("no_rope_layers"), text.get("num_hidden_layers", 48)
    if flags and (not isinstance(flags, list) or len(flags) != layers):
        # checked before transformers derives layer_types from it, for a clearer message
        raise ValueError(f"{where}: no_rope_layers must hold {layers} flags of 0 or 1, got "
                         f"{flags!r}")
    rope = _rope(text, where)
    if _transformers_major() >= 5:
        kwargs["rope_parameters"] = rope
    else:
        kwargs["rope_theta"] = rope["rope_theta"]
        extra = {k: v for k, v in rope.items() if k != "rope_theta"}
        kwargs["rope_scaling"] = None if rope["rope_type"] == "default" else extra
    return kwargs


def _config_errors() -> tuple:
    errors = [TypeError, ValueError]
    try:  # transformers 5.x's strict field checks
        from huggingface_hub.errors import StrictDataclassError

        errors.append(StrictDataclassError)
    except ImportError:
        pass
    return tuple(errors)


def read_config(model_dir) -> CheckpointConfig:
    """config.json of a checkpoint directory (text-only or multimodal), checked."""
    require_hf()
    from transformers import Llama4TextConfig

    path = Path(model_dir) / "config.json"
    raw = _read_json(path, "config.json")
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type == "llama4" and isinstance(raw.get("text_config"), dict):
        text, multimodal = raw["text_config"], True
    elif model_type == "llama4_text":
        text, multimodal = raw, False
    else:
        raise ValueError(f"{path}: expected a Llama-4 config (model_type 'llama4' with a "
                         f"text_config, or 'llama4_text'), got model_type {model_type!r}")
    kwargs = _text_kwargs(text, str(path))
    if multimodal and "tie_word_embeddings" not in kwargs and "tie_word_embeddings" in raw:
        kwargs["tie_word_embeddings"] = raw["tie_word_embeddings"]
    try:
        config = Llama4TextConfig(**kwargs)
    except _config_errors() as err:
        raise ValueError(f"{model_dir}: invalid config.json: {err}") from err
    check_supported(config)
    dtype = _dtype(text.get("torch_dtype") or text.get("dtype") or raw.get("torch_dtype")
                   or raw.get("dtype"), str(path))
    quant = parse_quantization_config(raw.get("quantization_config",
                                              text.get("quantization_config")))
    image = raw.get("image_token_index") if multimodal else None
    return CheckpointConfig(config, dtype, quant,
                            frozenset(_token_ids(config.eos_token_id, str(path))),
                            image if isinstance(image, int) else None, multimodal)


def load_text_config(model_dir) -> Llama4TextConfig:
    """The Llama-4 text config of a checkpoint directory (text-only or multimodal)."""
    return read_config(model_dir).text


def rope_parameters(config) -> dict:
    """{"rope_type", "rope_theta", ...} of a transformers config of either major version."""
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers 4.x: rope_scaling + rope_theta
        params = {**(getattr(config, "rope_scaling", None) or {}),
                  "rope_theta": getattr(config, "rope_theta", 500000.0)}
    params = dict(params)
    params["rope_type"] = params.pop("type", None) or params.get("rope_type") or "default"
    return params


def activation(config) -> nn.Module:
    """The MLP and experts' activation, ``config.hidden_act``, as transformers maps it."""
    from transformers.activations import ACT2FN

    name = getattr(config, "hidden_act", "silu")
    if not isinstance(name, str) or name not in ACT2FN:
        raise ValueError(f"unsupported hidden_act {name!r} in the config")
    return ACT2FN[name]


def supported_rope_type(config) -> str:
    """The config's rope_type, if this model computes it as transformers does."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = rope_parameters(config)["rope_type"]
    if rope_type != "default" and (rope_type not in _STATIC_ROPE
                                   or rope_type not in ROPE_INIT_FUNCTIONS):
        raise ValueError(f"unsupported rope_type {rope_type!r} in the config")
    return rope_type


def _positive(config, *names):
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"config {name} must be a positive integer, got {value!r}")


def check_supported(config) -> None:
    """Raise ValueError naming the first config field this model would not reproduce, or a
    size that cannot work (caught here, not as an error deep in torch at generate())."""
    _positive(config, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "intermediate_size", "intermediate_size_mlp",
              "max_position_embeddings")
    layers = config.num_hidden_layers
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(f"config num_attention_heads {config.num_attention_heads} is not a "
                         f"multiple of num_key_value_heads {config.num_key_value_heads}")
    if config.head_dim % 2:
        raise ValueError(f"config head_dim {config.head_dim} must be even (RoPE pairs)")
    moe = list(config.moe_layers)
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in moe) \
            or len(set(moe)) != len(moe):
        raise ValueError(f"config moe_layers {moe} must be distinct layer indices in "
                         f"[0, {layers})")
    if moe:
        _positive(config, "num_local_experts", "num_experts_per_tok")
        if config.num_experts_per_tok > config.num_local_experts:
            raise ValueError(f"config num_experts_per_tok {config.num_experts_per_tok} "
                             f"exceeds num_local_experts {config.num_local_experts}")
    rope_flags = list(config.no_rope_layers)
    if len(rope_flags) != layers or any(f not in (0, 1) for f in rope_flags):
        raise ValueError(f"config no_rope_layers must hold {layers} flags of 0 or 1, got "
                         f"{rope_flags}")
    chunk = config.attention_chunk_size
    if chunk is not None:
        _positive(config, "attention_chunk_size")
    if config.attn_temperature_tuning and not config.floor_scale > 0:
        raise ValueError(f"config floor_scale must be positive, got {config.floor_scale!r}")
    activation(config)
    supported_rope_type(config)
    for layer_idx in range(layers):
        layer_kind(config, layer_idx)


def layer_kind(config, layer_idx: int) -> Kind:
    """Kind.CHUNKED or Kind.GLOBAL, from ``layer_types`` when the config has it (transformers masks
    by it), else as transformers derives it: RoPE layers are chunked when there is a chunk."""
    types = getattr(config, "layer_types", None)
    use_rope = bool(config.no_rope_layers[layer_idx])
    if types is None:
        return Kind.CHUNKED if (use_rope and config.attention_chunk_size) else Kind.GLOBAL
    if len(types) != config.num_hidden_layers:
        raise ValueError(f"layer_types has {len(types)} entries for "
                         f"{config.num_hidden_layers} layers")
    kind = types[layer_idx]
    if kind == "chunked_attention" and config.attention_chunk_size:
        return Kind.CHUNKED
    if kind == "full_attention":
        return Kind.GLOBAL
    raise ValueError(f"layer {layer_idx}: unsupported layer type {kind!r} (expected "
                     "'full_attention', or 'chunked_attention' with attention_chunk_size set)")
