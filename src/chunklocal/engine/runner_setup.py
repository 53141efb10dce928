"""What a rank needs to build its attention backends, KV caches and CUDA graphs.

The engine decides the KV groups (specs, page counts) once; :class:`RunnerSetup`
carries that decision, picklable, to :func:`build_runner`, which runs in the
caller's process for one rank and in every worker process with tensor
parallelism.  Head counts are this rank's (a slice of the model's).

:func:`profile_run` runs the step and the CUDA-graph capture that size the activation and
graph reserves of ``gpu_memory_utilization`` (engine/memory.py) on a runner of its own, with
pools just large enough for them, before the engine's pools are sized.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from chunklocal._validate import cdiv
from chunklocal.backends.base import EngineLimits, Kind
from chunklocal.backends.factory import make_backend
from chunklocal.engine.block_manager import BlockManager, KVGroup
from chunklocal.engine.memory import DeviceMemory, peak_of
from chunklocal.engine.model_runner import ModelRunner
from chunklocal.engine.sampler import sampling_row
from chunklocal.engine.sampling import SamplingParams
from chunklocal.engine.scheduler import ScheduledBatch
from chunklocal.engine.sequence import Sequence
from chunklocal.kv_spec import FullAttentionSpec, merge


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
    calculate_kv_scales: bool = False  # FP8 KV scales from the first real step


def pool_sizes(pools, specs) -> tuple[tuple[FullAttentionSpec, int], ...]:
    """``RunnerSetup.groups`` of a bounds/kv_pools.py plan: (spec, pages) of each pool, a
    merged pool's spec merging its kinds'."""
    return tuple((merge([specs[k] for k in pool.kinds]) if len(pool.kinds) > 1
                  else specs[pool.kinds[0]], pool.pages) for pool in pools.groups)


def build_runner(setup: RunnerSetup, model, device, block_manager=None,
                 capture_graphs: bool = True) -> ModelRunner:
    """This rank's runner.  ``block_manager``: the engine's (one rank), or None for a
    worker, whose steps arrive with their block tables already made.  ``capture_graphs``
    False: the backends still hold their graph buffers, but nothing is captured."""
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
    runner.capture_rows_per_pass = setup.limits.max_num_seqs  # as many as the profile held
    runner.kv_calibration_pending = setup.calculate_kv_scales
    if setup.cuda_graphs and capture_graphs:
        runner.enable_cuda_graphs(backends[0].graph_batch_sizes, backends[0].graph_query_lens,
                                  setup.graph_recorder, setup.limits.max_num_batched_tokens)
    return runner


def profile_batch(num_requests: int, tokens: int, block_size: int, vocab_size: int,
                  groups: list[KVGroup], max_model_len: int | None = None
                  ) -> tuple[ScheduledBatch, BlockManager]:
    """``tokens`` prompt tokens over ``num_requests`` requests (as even as can be), one
    step, with a block manager of ``groups`` (each large enough) holding their pages.

    Each request but the first (of several) whose length leaves room under
    ``max_model_len`` (None: every one) has one more prompt token already computed, so its
    rows also read an earlier key: the attention backends' earlier-keys path (the ragged
    own-keys split's paged part and the log-sum-exp merge, backends/flashinfer/own_keys.py)
    allocates for nearly every row in this step, and the profile counts it.  The first
    stays fresh because a part every row reads merges without gathering the rows
    (``own_keys.ALL_ROWS``), lighter than a real step whose rows only partly read earlier
    keys: that heavier form is the one to profile.  Its KV is
    whatever the page holds: the profile reads the memory, not the values.  Pages: a
    request of n + 1 positions needs floor(n / block_size) + 1 <= n / block_size + 1 of
    them, so all fit in cdiv(tokens, block_size) + num_requests (profile_run's count)."""
    lens = [tokens // num_requests + (i < tokens % num_requests) for i in range(num_requests)]
    manager = BlockManager(groups, num_requests, cdiv(max(lens) + 1, block_size))
    batch, row = ScheduledBatch(), sampling_row(SamplingParams(temperature=0.0))
    start = 0
    for i, n in enumerate(lens):
        earlier = int((i > 0 or num_requests == 1)
                      and (max_model_len is None or n < max_model_len))
        # Varied ids: the MoE routes them over many experts, as real prompts are.
        seq = Sequence(i, [(7919 * (start + j)) % vocab_size for j in range(n + earlier)],
                       SamplingParams(max_tokens=1, temperature=0.0), len(groups))
        seq.sampling_row = row
        manager.allocate(seq, n + earlier)
        seq.num_computed = earlier
        batch.add(seq, n)
        start += n
    return batch, manager


def profile_run(setup: RunnerSetup, model, device, memory: DeviceMemory,
                vocab_size: int) -> tuple[int, int]:
    """(activations, graphs): bytes the largest step allocates at its peak above the
    weights (the backends' buffers included, the profile's own KV pages not), and what
    capturing the engine's CUDA graphs allocates at its peak (0 without graphs).

    The largest step is vLLM's profile shape: ``max_num_batched_tokens`` tokens (no more
    than ``max_num_seqs`` whole requests hold) over ``max_num_seqs`` prompts (fewer when
    there are fewer tokens), each no longer than ``max_model_len``, every one sampled;
    and each prompt past one computed token where it fits (:func:`profile_batch`)."""
    lim = setup.limits
    tokens = min(lim.max_num_batched_tokens, lim.max_num_seqs * lim.max_model_len)
    count = max(min(lim.max_num_seqs, tokens), cdiv(tokens, lim.max_model_len))
    pages = count + cdiv(tokens, lim.block_size) + 1  # any split of the tokens fits
    batch, manager = profile_batch(count, tokens, lim.block_size, vocab_size,
                                   [KVGroup(spec, pages) for spec, _ in setup.groups],
                                   lim.max_model_len)
    made: list[ModelRunner] = []

    def first_step():
        made.append(build_runner(replace(setup, graph_recorder=None, calculate_kv_scales=False),
                                 model, device, manager, capture_graphs=False))
        made[0].run(batch)

    activations = peak_of(memory, first_step) - _kv_bytes(model)
    runner, graphs = made[0], 0
    if setup.cuda_graphs:  # captured as the engine will (same sizes, same recorder), then
        #                     dropped: what the graphs hold at the peak of their capture
        first = runner.backends[0]
        graphs = peak_of(memory, partial(runner.enable_cuda_graphs, first.graph_batch_sizes,
                                         first.graph_query_lens, setup.graph_recorder,
                                         lim.max_num_batched_tokens))
        runner.graphs = runner.piecewise = None
    for layer in model.layers:  # the profile's pages go; the engine's runner binds its own
        layer.self_attn.k_cache = layer.self_attn.v_cache = None
    made.clear()  # the profile's runner and buffers go too
    del runner
    memory.empty_cache()
    return max(activations, 0), graphs


def _kv_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for layer in model.layers
               for t in (layer.self_attn.k_cache, layer.self_attn.v_cache))
