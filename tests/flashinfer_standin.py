"""A strict CPU stand-in for FlashInfer 0.7.2.post1, for tests (no GPU, no flashinfer).

``install(monkeypatch)`` puts a fake ``flashinfer`` package (a plain module object, so a
missing attribute raises AttributeError) and ``flashinfer.sampling`` in ``sys.modules``.
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

import flashinfer_standin_sampling as standin_sampling
from flashinfer_standin_wrappers import (
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
)

__version__ = "0.7.2.post1"
__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
           "build_module", "install", "installed"]


def build_module() -> types.ModuleType:
    """A fresh fake ``flashinfer`` package with its ``sampling`` submodule."""
    sampling = types.ModuleType("flashinfer.sampling", "FlashInfer 0.7.2.post1 stand-in")
    sampling.__spec__ = importlib.machinery.ModuleSpec("flashinfer.sampling", None)
    sampling.top_k_top_p_sampling_from_logits = standin_sampling.top_k_top_p_sampling_from_logits
    package = types.ModuleType("flashinfer", __doc__)
    package.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None, is_package=True)
    package.__path__ = []
    package.__version__ = __version__
    package.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    package.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    package.sampling = sampling
    return package


def install(monkeypatch) -> types.ModuleType:
    """Make ``import flashinfer`` / ``import flashinfer.sampling`` give the stand-in."""
    module = build_module()
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setitem(sys.modules, "flashinfer.sampling", module.sampling)
    return module


@contextlib.contextmanager
def installed():
    """``install`` without pytest: ``with installed() as flashinfer: ...``."""
    names = ("flashinfer", "flashinfer.sampling")
    saved = {name: sys.modules.get(name) for name in names}
    module = build_module()
    sys.modules.update({"flashinfer": module, "flashinfer.sampling": module.sampling})
    try:
        yield module
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
