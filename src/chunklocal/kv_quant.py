"""FP8 KV cache (``kv_cache_dtype``): the page dtype and the write path's quantization.

``kv_cache_dtype`` is "auto" (pages in the model's dtype, no quantization) or "fp8" /
"fp8_e4m3" (vLLM's names): pages of ``torch.float8_e4m3fn`` with one float32 scale per
layer for K and one for V (``Attention.k_scale`` / ``v_scale``: the checkpoint's, read by
models/kv_scales.py, else 1.0 as vLLM does for a checkpoint that carries none).  The
write path stores ``e4m3(clamp(x / scale, -448, 448))``; readers dequantize
``float(page) * scale``: the torch backend inside
:func:`chunklocal.reference.run_paged_attention`, FlashInfer through
``run(k_scale=, v_scale=)``.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def check_kv_cache_dtype(value) -> str:
    """The argument normalised: "auto" or "fp8" (ValueError naming it otherwise)."""
    if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {value!r}")
    return "auto" if value == "auto" else "fp8"


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pages' dtype: the model's for "auto", e4m3 for "fp8"."""
    return model_dtype if check_kv_cache_dtype(kv_cache_dtype) == "auto" else FP8_KV_DTYPE


#: ``calculate_kv_scales``: a layer's K (V) scale is the first real step's max |K| (|V|) over
#: these, vLLM's ``K_SCALE_CONSTANT`` / ``V_SCALE_CONSTANT`` defaults: the amax lands at 200
#: (100) of e4m3's 448, room for later tokens of larger magnitude before they saturate.
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0


def calibrated_scales(k: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
    """(k_scale, v_scale) of ``calculate_kv_scales`` from one step's keys and values (two
    host syncs, once per layer per engine); an all-zero tensor keeps its scale of 1."""
    k_amax, v_amax = float(k.abs().amax()), float(v.abs().amax())
    return (k_amax / K_SCALE_CONSTANT if k_amax > 0 else 1.0,
            v_amax / V_SCALE_CONSTANT if v_amax > 0 else 1.0)


def is_fp8(tensor_or_dtype) -> bool:
    dtype = getattr(tensor_or_dtype, "dtype", tensor_or_dtype)
    return dtype == FP8_KV_DTYPE


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` clamped to e4m3's range (saturation whatever the device's cast does
    past 448: e4m3fn has no infinity), in e4m3."""
    return (x.float() / float(scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize(x: torch.Tensor, scale: float, dtype=torch.float32) -> torch.Tensor:
    return x.to(dtype) * float(scale)


def write_fp8(flat_cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
              scale: float) -> None:
    """``flat_cache[slots] = quantize(x, scale)``; through uint8 views (index_copy_ has
    no float8 kernel on the CPU)."""
    flat_cache.view(torch.uint8).index_copy_(0, slots, quantize(x, scale).view(torch.uint8))
