"""chunklocal: chunked local attention (Llama-4 iRoPE) over a paged KV cache."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Public name -> module that defines it, imported on first use: `import chunklocal`
# stays a hundredth of a second instead of paying for torch and the engine up front
# (BENCHMARKS.md, "Import time"), and the numpy-only bounds stay cheap to reach.
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
    "FlashInferBackend": "backends.flashinfer.backend",
    "MetadataBuffers": "backends.flashinfer.buffers",
    "CapacityError": "backends.flashinfer.buffers",
    "LLM": "engine.llm",
    "WorkerError": "engine.workers",
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
