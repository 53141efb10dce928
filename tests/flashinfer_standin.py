"""A strict CPU stand-in for FlashInfer 0.7.2.post1, for tests (no GPU, no flashinfer).

``install(monkeypatch)`` puts a fake ``flashinfer`` package (a plain module object, so a
missing attribute raises AttributeError), ``flashinfer.sampling`` and
``flashinfer.activation`` in ``sys.modules``.
``installed()`` does the same without pytest, as a context manager.

The wrappers have 0.7.2.post1's exact ``__init__`` / ``plan`` / ``run`` parameter lists
(names, order, defaults, keyword-only markers; annotations dropped) and compute exact
attention in float32.  CUDA-graph mode keeps the caller's metadata buffers, plan()
copies into them, and run() reads them *at run time*, so buffers rewritten in place
between runs (what the engine does before a replay) are what run() attends over.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types

import flashinfer_standin_core as standin_core
import flashinfer_standin_sampling as standin_sampling
import torch
from flashinfer_standin_wrappers import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
)

__version__ = "0.7.2.post1"
__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
           "BatchPrefillWithRaggedKVCacheWrapper", "build_module", "install", "installed"]


def silu_and_mul(input: torch.Tensor, out: torch.Tensor = None, enable_pdl=None
                 ) -> torch.Tensor:
    """0.7.2.post1's ``flashinfer.activation.silu_and_mul``: ``silu(x[..., :d]) *
    x[..., d:]`` in float32, rounded once.  Its checks (an even last dim; ``out``'s shape),
    and one it does not make: its kernel walks ``numel / last dim`` rows of ``2 d``
    elements from the data pointer, so a strided input would be read wrong in silence;
    here it raises."""
    if input.shape[-1] % 2 != 0:
        raise ValueError("The last dimension must be even (2 * hidden_size).")
    if not input.is_contiguous():
        raise ValueError("stand-in: the kernel reads rows of 2 * hidden_size contiguous "
                         "elements; this input is strided")
    d = input.shape[-1] // 2
    if out is not None:
        assert input.ndim == out.ndim and input.shape[:-1] == out.shape[:-1] \
            and input.shape[-1] == 2 * out.shape[-1]
    else:
        out = torch.empty(input.shape[:-1] + (d,), device=input.device, dtype=input.dtype)
    x = input.float()
    out.copy_(x[..., :d] / (1.0 + torch.exp(-x[..., :d])) * x[..., d:])
    return out


def build_module() -> types.ModuleType:
    """A fresh fake ``flashinfer`` package with its ``sampling`` and ``activation``
    submodules."""
    sampling = types.ModuleType("flashinfer.sampling", "FlashInfer 0.7.2.post1 stand-in")
    sampling.__spec__ = importlib.machinery.ModuleSpec("flashinfer.sampling", None)
    sampling.top_k_top_p_sampling_from_logits = standin_sampling.top_k_top_p_sampling_from_logits
    activation = types.ModuleType("flashinfer.activation", "FlashInfer 0.7.2.post1 stand-in")
    activation.__spec__ = importlib.machinery.ModuleSpec("flashinfer.activation", None)
    activation.silu_and_mul = silu_and_mul
    package = types.ModuleType("flashinfer", __doc__)
    package.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None, is_package=True)
    package.__path__ = []
    package.__version__ = __version__
    package.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    package.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    package.BatchPrefillWithRaggedKVCacheWrapper = BatchPrefillWithRaggedKVCacheWrapper
    cascade = types.ModuleType("flashinfer.cascade", "FlashInfer 0.7.2.post1 stand-in")
    cascade.merge_state = package.merge_state = standin_core.merge_state
    package.cascade = cascade
    package.sampling = sampling
    package.activation = activation
    return package


def install(monkeypatch) -> types.ModuleType:
    """Make ``import flashinfer`` / ``import flashinfer.sampling`` give the stand-in."""
    module = build_module()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setitem(sys.modules, "flashinfer.sampling", module.sampling)
    monkeypatch.setitem(sys.modules, "flashinfer.activation", module.activation)
    return module


@contextlib.contextmanager
def installed():
    """``install`` without pytest: ``with installed() as flashinfer: ...``."""
    names = ("flashinfer", "flashinfer.sampling", "flashinfer.activation")
    saved = {name: sys.modules.get(name) for name in names}
    module = build_module()
    sys.modules.update({"flashinfer": module, "flashinfer.sampling": module.sampling,
                        "flashinfer.activation": module.activation})
    try:
        yield module
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
