"""The one place an attention backend is chosen and built for a KV group.

The engine names a backend ("auto", "torch" or "flashinfer") and this module
resolves the name for a device and builds one backend per KV group; the engine
never sees a backend's constructor.
"""

from __future__ import annotations

import torch

from chunklocal.backends.base import AttentionBackend, EngineLimits
from chunklocal.kv_spec import FullAttentionSpec

BACKENDS = ("torch", "flashinfer")
#: Device types each backend runs on by default (a caller may widen them: the tests run
#: the FlashInfer path on the CPU against a strict stand-in of the library).
BACKEND_DEVICES = {"torch": ("cpu", "cuda"), "flashinfer": ("cuda",)}


def resolve_backend(name: str, device: torch.device, devices=None) -> str:
    """``name`` ("auto", "torch", "flashinfer") for ``device``: ValueError naming both
    when the backend is unknown or does not run there."""
    devices = BACKEND_DEVICES if devices is None else devices
    if name == "auto":
        return "flashinfer" if device.type == "cuda" else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r} "
                         "(expected 'auto', 'torch' or 'flashinfer')")
    if device.type not in devices[name]:
        raise ValueError(f"attention_backend={name!r} needs a CUDA device, got {device}")
    return name


def make_backend(name: str, spec: FullAttentionSpec, limits: EngineLimits, *, num_q_heads: int,
                 dtype: torch.dtype, device, cuda_graphs: bool = False,
                 num_speculative_tokens: int = 0,
                 scratch_page: int | None = None) -> AttentionBackend:
    """One backend for a KV group of ``spec`` (this rank's KV heads; ``num_q_heads`` the
    query heads that read it).  With ``cuda_graphs`` the backend captures decode steps
    and, when ``num_speculative_tokens`` k > 0, verify windows of k + 1 tokens; padding
    rows read ``scratch_page`` (the group's reserved page)."""
    if name == "torch":
        from chunklocal.backends.torch_ref import TorchRefBackend

        # Plans live where q and the caches do; Hq sizes the memory-bounded groups.
        return TorchRefBackend(spec, num_q_heads=num_q_heads, device=device)
    if name == "flashinfer":
        from chunklocal.backends.flashinfer import FlashInferBackend

        k = num_speculative_tokens
        return FlashInferBackend(spec, limits, num_q_heads, spec.num_kv_heads, spec.head_dim,
                                 dtype, device, cuda_graphs, verify_len=k + 1 if k else None,
                                 scratch_page=scratch_page)
    raise ValueError(f"unknown attention backend {name!r} (expected one of {BACKENDS})")
