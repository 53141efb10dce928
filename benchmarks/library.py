"""chunklocal's own metadata builder and FlashInfer backend behind the StepBuilder interface.

Chunked and global layers get one backend each (the hybrid layout: one KV group
per kind), both sized from EngineLimits that just fit the batch.  On the CPU
only the host part exists: ``write_step`` into persistent ``MetadataBuffers``
(virtual batches + paged-KV arrays), which is what ``FlashInferBackend.build``
does before it plans.
"""

from __future__ import annotations

import numpy as np
import torch

from benchmarks import workloads as wl
from benchmarks.steps import StepBuilder, StepBuilders, random_inputs
from chunklocal.backends.base import EngineLimits
from chunklocal.kv_spec import ChunkedLocalAttentionSpec, FullAttentionSpec


def limits_for(batch: wl.Batch, block: int, max_num_seqs: int | None = None) -> EngineLimits:
    model_len = int(-(-int(batch.seq_lens.max()) // block) * block)
    return EngineLimits(max_num_seqs=max(max_num_seqs or 0, batch.num_reqs),
                        max_num_batched_tokens=max(batch.num_tokens, 1),
                        max_model_len=model_len, block_size=block)


def specs(chunk: int, block: int, dtype=torch.bfloat16):
    geometry = (block, wl.NUM_KV_HEADS, wl.HEAD_DIM, dtype)
    return (ChunkedLocalAttentionSpec(*geometry, attention_chunk_size=chunk),
            FullAttentionSpec(*geometry))


def library_step_builders(batch: wl.Batch, device: str, chunk: int, block: int) -> StepBuilders:
    limits = limits_for(batch, block)
    args = (batch.query_start_loc, batch.seq_lens, batch.block_table)
    if device == "cpu":
        return _host_only(batch, limits, chunk, block)
    from chunklocal.backends.flashinfer import FlashInferBackend

    q, k_cache, v_cache = random_inputs(batch, device, block)
    scale = wl.HEAD_DIM ** -0.5
    builders = []
    num_vb = 0
    for spec in specs(chunk, block):
        backend = FlashInferBackend(spec, limits, wl.NUM_Q_HEADS, wl.NUM_KV_HEADS, wl.HEAD_DIM,
                                    torch.bfloat16, device)
        state = {"md": backend.build(*args)}

        def build(backend=backend, state=state):
            state["md"] = backend.build(*args)

        def forward(backend=backend, state=state):
            return backend.forward(state["md"], q, k_cache, v_cache, scale)

        builders.append(StepBuilder(build, forward, lambda: (q, k_cache, v_cache)))
    from chunklocal.virtual_batches import make_virtual_batches

    num_vb = make_virtual_batches(*args, chunk, block).num_batches
    return StepBuilders("chunklocal (FlashInferBackend)", builders[0], builders[1], num_vb)


def chunked_forward(batch: wl.Batch, chunk: int, block: int, inputs, **backend_kwargs):
    """A planned chunked-layer forward on ``inputs`` (q, k, v) with other backend options."""
    from chunklocal.backends.flashinfer import FlashInferBackend

    q, k_cache, v_cache = inputs
    backend = FlashInferBackend(specs(chunk, block)[0], limits_for(batch, block), wl.NUM_Q_HEADS,
                                wl.NUM_KV_HEADS, wl.HEAD_DIM, torch.bfloat16, q.device,
                                **backend_kwargs)
    md = backend.build(batch.query_start_loc, batch.seq_lens, batch.block_table)
    scale = wl.HEAD_DIM ** -0.5
    return lambda: backend.forward(md, q, k_cache, v_cache, scale)


def _host_only(batch: wl.Batch, limits: EngineLimits, chunk: int, block: int) -> StepBuilders:
    from chunklocal.backends.flashinfer.buffers import MetadataBuffers, write_step
    from chunklocal.bounds.sizing import step_capacity
    from chunklocal.kv_spec import Kind

    qsl, seq, table = batch.query_start_loc, batch.seq_lens, batch.block_table
    query_lens = np.diff(qsl)
    builders = []
    num_vb = 0
    for spec, c in zip(specs(chunk, block), (chunk, None), strict=True):
        kind = Kind.CHUNKED if c else Kind.GLOBAL
        buffers = MetadataBuffers(step_capacity(spec, limits, kind=kind), block,
                                  device="cpu", name="chunked" if c else "global")

        def build(buffers=buffers, c=c):
            return write_step(buffers, qsl, seq, table, query_lens, c)

        num_vb = num_vb or build().num_batches
        builders.append(StepBuilder(build))
    return StepBuilders("chunklocal (host: write_step)", builders[0], builders[1], num_vb)
