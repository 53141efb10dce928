"""One step's attention for one KV group, as two callables: host ``build`` and device ``forward``.

``make_step_builders(batch, device, implementation)`` returns them for a chunked
group (c = 8192) and a global group over the same batch, so every benchmark
times the same thing the same way.  ``implementation``:

* ``chunklocal``: the library's FlashInfer builder/backend (``build()`` once per
  step, ``forward()`` per layer);
* ``direct``: ``make_virtual_batches`` + numpy paged-KV arrays + FlashInfer's own
  wrappers (benchmarks/direct.py); on the CPU, the host part alone;
* ``torch``: the CPU reference backend (``chunklocal.backends.torch_ref``), so the
  smoke runs exercise the benchmark logic without a GPU;
* ``auto``: ``chunklocal`` when it imports, else ``direct`` (``torch`` on the CPU
  when a forward is needed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from benchmarks import workloads as wl
from benchmarks.direct import DirectRunner, host_metadata


@dataclass
class StepBuilder:
    build: Callable[[], object]
    forward: Callable[[], object] | None = None
    #: () -> (q, k_cache, v_cache) the forward reads, for cross-checks.
    inputs: Callable[[], tuple] | None = None


@dataclass
class StepBuilders:
    implementation: str
    chunked: StepBuilder
    global_: StepBuilder
    num_virtual_batches: int


def library_available() -> bool:
    try:
        import chunklocal.backends.flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or flashinfer missing on a CPU machine
        return False
    return True


def make_step_builders(batch: wl.Batch, device: str, implementation: str = "auto",
                       chunk: int = wl.CHUNK, block: int = wl.BLOCK) -> StepBuilders:
    if implementation == "auto":
        implementation = "chunklocal" if library_available() else "direct"
    if implementation == "chunklocal":
        from benchmarks.library import library_step_builders

        return library_step_builders(batch, device, chunk, block)
    if implementation == "torch":
        return torch_step_builders(batch, device, chunk, block)
    return direct_step_builders(batch, device, chunk, block)


def torch_step_builders(batch: wl.Batch, device: str, chunk: int, block: int) -> StepBuilders:
    from benchmarks.library import specs
    from chunklocal.backends.torch_ref import TorchRefBackend

    q, k_cache, v_cache = random_inputs(batch, device, block)
    scale = wl.HEAD_DIM ** -0.5
    args = (batch.query_start_loc, batch.seq_lens, batch.block_table)
    builders, states = [], []
    for spec in specs(chunk, block):
        backend = TorchRefBackend(spec, num_q_heads=wl.NUM_Q_HEADS, device=device)
        state = {"meta": backend.build(*args)}
        states.append(state)

        def build(backend=backend, state=state):
            state["meta"] = backend.build(*args)

        def forward(backend=backend, state=state):
            return backend.forward(state["meta"], q, k_cache, v_cache, scale)

        builders.append(StepBuilder(build, forward, lambda: (q, k_cache, v_cache)))
    from chunklocal.kv_spec import Kind

    num_vb = int(states[0]["meta"][Kind.CHUNKED].seq_lens.shape[0])
    return StepBuilders("torch reference", builders[0], builders[1], num_vb)


def direct_step_builders(batch: wl.Batch, device: str, chunk: int, block: int) -> StepBuilders:
    args = (batch.query_start_loc, batch.seq_lens, batch.block_table, block)
    num_vb = host_metadata(*args, chunk).num_problems
    if device == "cpu":
        return StepBuilders("direct (numpy)",
                            StepBuilder(lambda: host_metadata(*args, chunk)),
                            StepBuilder(lambda: host_metadata(*args, None)), num_vb)
    import torch

    dtype = torch.bfloat16
    decode = bool(np.all(batch.query_lens == 1))
    q, k_cache, v_cache = random_inputs(batch, device, block)
    builders = []
    for c in (chunk, None):
        runner = DirectRunner(device, wl.NUM_Q_HEADS, wl.NUM_KV_HEADS, wl.HEAD_DIM, block,
                              decode)
        out = torch.empty_like(q)

        def build(runner=runner, c=c):
            runner.plan(host_metadata(*args, c), dtype)

        def forward(runner=runner, out=out):
            return runner.run(q, (k_cache, v_cache), out=out)

        build()
        builders.append(StepBuilder(build, forward, lambda: (q, k_cache, v_cache)))
    return StepBuilders("direct (FlashInfer wrappers)", builders[0], builders[1], num_vb)


def random_inputs(batch: wl.Batch, device, block: int, seed: int = 0):
    """Random bf16 queries [tokens, Hq, D] and K, V pools [pages, block, Hkv, D] (NHD)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch.num_tokens, wl.NUM_Q_HEADS, wl.HEAD_DIM, device=device,
                    dtype=torch.bfloat16, generator=gen)
    shape = (batch.num_pages, block, wl.NUM_KV_HEADS, wl.HEAD_DIM)
    k = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)
    return q, k, v
