"""chunklocal: chunked local attention (Llama-4 iRoPE) over a paged KV cache."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public name -> module that defines it.  Imported on first use so that
# `import chunklocal` stays cheap and optional parts (GPU, transformers) load
# only when asked for.
_EXPORTS = {
    "make_virtual_batches": "virtual_batches",
    "VirtualBatches": "virtual_batches",
    "FullAttentionSpec": "kv_spec",
    "ChunkedLocalAttentionSpec": "kv_spec",
    "chunk_size_of": "kv_spec",
    "merge": "kv_spec",
    "reference_attention": "reference",
    "paged_causal_attention": "reference",
    "plan_paged_attention": "reference",
    "run_paged_attention": "reference",
    "PagedAttentionPlan": "reference",
    "max_virtual_batches": "bounds",
    "max_local_pages": "bounds",
    "max_verify_batches": "bounds",
    "published_virtual_batches_bound": "bounds",
    "max_global_pages": "bounds",
    "max_group_pages": "bounds",
    "max_uniform_verify_batches": "bounds",
    "max_verify_batches_of_length": "bounds",
    "buffer_sizes": "bounds",
    "BufferSizes": "bounds",
    "EngineLimits": "backends.base",
    "FlashInferBackend": "backends.flashinfer",
    "MetadataBuffers": "metadata",
    "CapacityError": "metadata",
    "LLM": "engine.llm",
    "SamplingParams": "engine.sampling",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "EngineCore": "engine.core",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'chunklocal' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"chunklocal.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
