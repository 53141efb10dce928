"""Which Llama-4 text configs the model reproduces, read from a checkpoint directory.

Every field the model would not compute as transformers does (an activation it
does not know, a rope type whose frequencies follow the running sequence length,
a layer type other than full or chunked attention) raises ValueError when the
config is read, before any weight is loaded.
"""

from __future__ import annotations

import torch.nn as nn

from chunklocal.backends.base import Kind


def require_hf() -> None:
    """Checkpoints are read with transformers and safetensors (the ``hf`` extra)."""
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as err:
        raise ImportError(f"serving a checkpoint needs transformers and safetensors ({err}); "
                          'install them with: pip install "chunklocal[hf]"') from err


def load_text_config(model_dir):
    """The Llama-4 text config of a checkpoint directory (text-only or multimodal)."""
    require_hf()
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except StrictDataclassError as err:  # transformers' own field checks
        raise ValueError(f"{model_dir}: invalid config.json: {err}") from err
    text = getattr(config, "text_config", None)
    config = text if text is not None else config
    if getattr(config, "model_type", None) != "llama4_text":
        raise ValueError(f"{model_dir}: expected a Llama-4 config, got model_type "
                         f"{getattr(config, 'model_type', None)!r}")
    check_supported(config)
    return config


def activation(config) -> nn.Module:
    """The MLP and experts' activation, ``config.hidden_act``, as transformers maps it."""
    from transformers.activations import ACT2FN

    name = getattr(config, "hidden_act", "silu")
    if not isinstance(name, str) or name not in ACT2FN:
        raise ValueError(f"unsupported hidden_act {name!r} in the config")
    return ACT2FN[name]


def supported_rope_type(config) -> str:
    """``rope_parameters["rope_type"]``, if this model computes it as transformers does."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    # dynamic and longrope rescale the frequencies with the running sequence length;
    # one table of frequencies for every request cannot reproduce that.
    if rope_type != "default" and (rope_type in ("dynamic", "longrope")
                                   or rope_type not in ROPE_INIT_FUNCTIONS):
        raise ValueError(f"unsupported rope_type {rope_type!r} in the config")
    return rope_type


def check_supported(config) -> None:
    """Raise ValueError naming the first config field this model would not reproduce."""
    activation(config)
    supported_rope_type(config)
    for layer_idx in range(config.num_hidden_layers):
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
