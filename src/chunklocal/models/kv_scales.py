"""Per-layer FP8 KV-cache scales a checkpoint may carry (vLLM's names).

``model.layers.N.self_attn.k_scale`` / ``v_scale``, or ``...self_attn.k_proj.output_scale`` /
``v_proj.output_scale``: one positive float per layer and K / V, the dequantization scale of
its FP8 pages (chunklocal/kv_quant.py).  They are split from the weights before the routes
are checked (no parameter takes them) and set on ``Attention.k_scale`` / ``v_scale`` after
the weights load; a layer without one keeps 1.0, as vLLM does.  With ``kv_cache_dtype``
"auto" they are read and unused.
"""

from __future__ import annotations

import math
import re

from chunklocal.models.checkpoint import Tensor, open_safetensors

_KV_SCALE = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\.(?:([kv])_scale|([kv])_proj\.output_scale)$")
_FLOATS = ("F32", "F16", "BF16")


def split_kv_scales(tensors: dict[str, Tensor], num_layers: int):
    """(the other tensors, {(layer, "k" | "v"): Tensor}); ValueError for a scale of a layer
    the config lacks, of a shape other than a scalar, of a non-float dtype, or given twice."""
    rest: dict[str, Tensor] = {}
    scales: dict[tuple[int, str], Tensor] = {}
    for canon, tensor in tensors.items():
        match = _KV_SCALE.match(canon)
        if match is None:
            rest[canon] = tensor
            continue
        layer, which = int(match.group(1)), match.group(2) or match.group(3)
        if layer >= num_layers:
            raise ValueError(f"KV scale {tensor.name} in {tensor.file.name}: the config has "
                             f"{num_layers} layers")
        if tuple(tensor.shape) not in ((), (1,)) or tensor.dtype not in _FLOATS:
            raise ValueError(f"KV scale {tensor.name} in {tensor.file.name} must be one float "
                             f"(shape [] or [1]), got {tensor.dtype} {list(tensor.shape)}")
        if (layer, which) in scales:
            raise ValueError(f"tensors {scales[layer, which].name} and {tensor.name} both "
                             f"give layer {layer}'s {which}_scale")
        scales[layer, which] = tensor
    return rest, scales


def apply_kv_scales(model, scales: dict) -> None:
    """Read each scale and set it on its layer's attention; ValueError unless positive
    and finite."""
    for (layer, which), tensor in sorted(scales.items()):
        with open_safetensors(tensor.file) as f:
            value = float(f.get_tensor(tensor.name).float().reshape(()))
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"KV scale {tensor.name} in {tensor.file.name} must be positive "
                             f"and finite, got {value}")
        setattr(model.model.layers[layer].self_attn, f"{which}_scale", value)
