"""What a rank needs to build its attention backends, KV caches and CUDA graphs.

The engine decides the KV groups (specs, page counts) once; :class:`RunnerSetup`
carries that decision, picklable, to :func:`build_runner`, which runs in the
caller's process for one rank and in every worker process with tensor
parallelism.  Head counts are this rank's (a slice of the model's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from chunklocal.backends.base import EngineLimits, Kind
from chunklocal.backends.factory import make_backend
from chunklocal.engine.block_manager import BlockManager, KVGroup
from chunklocal.engine.model_runner import ModelRunner
from chunklocal.kv_spec import FullAttentionSpec


@dataclass(frozen=True)
class RunnerSetup:
    groups: tuple[tuple[FullAttentionSpec, int], ...]  # (spec, num_blocks) per KV group;
    #                                                    specs hold this rank's KV heads
    kind_to_group: dict[Kind, int]  # layer kind -> KV group index
    backend: str            # "torch" or "flashinfer"
    limits: EngineLimits
    num_q_heads: int        # this rank's query heads
    kv_dtype: torch.dtype
    num_speculative_tokens: int
    cuda_graphs: bool
    seed: int
    chunk_size: int | None
    #: Records the CUDA graphs (engine/cuda_graphs.py GraphRecorder); None: torch.cuda's.
    graph_recorder: Any = None


def build_runner(setup: RunnerSetup, model, device, block_manager=None) -> ModelRunner:
    """This rank's runner.  ``block_manager``: the engine's (one rank), or None for a
    worker, whose steps arrive with their block tables already made."""
    if block_manager is None:
        block_manager = BlockManager([KVGroup(spec, n) for spec, n in setup.groups], 1, 1)
    backends = [make_backend(setup.backend, grp.spec, setup.limits,
                             num_q_heads=setup.num_q_heads, dtype=setup.kv_dtype, device=device,
                             cuda_graphs=setup.cuda_graphs,
                             num_speculative_tokens=setup.num_speculative_tokens,
                             scratch_page=grp.scratch_page)
                for grp in block_manager.groups]
    runner = ModelRunner(model, block_manager, setup.kind_to_group, backends, device,
                         setup.kv_dtype, setup.seed, chunk_size=setup.chunk_size)
    if setup.cuda_graphs:
        runner.enable_cuda_graphs(backends[0].graph_batch_sizes, backends[0].graph_query_lens,
                                  setup.graph_recorder)
    return runner
