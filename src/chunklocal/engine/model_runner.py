"""Run one step of a scheduled batch and pick the next tokens: the device half.

Per step the runner takes its host-built inputs (engine/input_builder.py: flat
``input_ids`` / ``positions``, and for every KV group one block table and one slot
mapping) and makes exactly one ``backend.build()`` per KV group, whose metadata all the
group's layers share.  Hybrid mode: chunked layers read
the chunked group, global layers the global group.  Merged mode: both kinds read
the single group (the one build prepares both).  This is the only place a batch
becomes attention metadata: decode and verify steps that replay a CUDA graph
(engine/cuda_graphs.py) get theirs from the same ``build_steps``.

With tensor parallelism (engine/tp_runner.py) the host half (:class:`InputBuilder`) runs
once in the caller's process, in a :class:`RemoteRunner`, and every rank runs
:meth:`ModelRunner.forward` on the same inputs; rank 0 samples with its :class:`Sampler`.
Both are step runners (:class:`StepRunner`): what the engine core calls.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import numpy as np
import torch

from chunklocal.backends.base import AttentionStep, Kind
from chunklocal.engine import piecewise_graphs
from chunklocal.engine.block_manager import BlockManager
from chunklocal.engine.cuda_graphs import CudaGraphs
from chunklocal.engine.input_builder import InputBuilder, StepInputs
from chunklocal.engine.sampler import DeviceSample, Sampler, SampleResult, to_device
from chunklocal.engine.scheduler import ScheduledBatch
from chunklocal.kv_quant import is_fp8


@dataclass
class StepOutput:
    tokens: list[np.ndarray]    # per request: the tokens chosen at its logit rows
    sample: SampleResult        # per logit row (tokens, logprobs)
    row_bounds: np.ndarray      # [N+1]: request i owns rows row_bounds[i]:row_bounds[i+1]


@dataclass
class LaunchedStep:
    """A step queued on the device whose sampled tokens are not on the host yet."""
    batch: ScheduledBatch
    sample: DeviceSample
    row_bounds: np.ndarray      # [N+1] logit rows per request
    overlap_safe: bool          # the next step may launch before this one is collected:
    #                             a graph replay, or eager on backends that allow it
    step: int = 0               # the engine core's step number


def _builder_field(name: str) -> property:
    """``runner.<name>`` is the InputBuilder's (statistics and capture state)."""
    return property(lambda self: getattr(self.builder, name),
                    lambda self, value: setattr(self.builder, name, value))


class StepRunner:
    """What the engine core calls on a runner, one process or N ranks: ``launch`` a step,
    ``collect`` its tokens (``run``: both); the host half's statistics and prompt-logit
    capture state (:class:`InputBuilder`) under the runner's names."""

    builder: InputBuilder
    graph_steps: int = 0

    tokens_per_step = _builder_field("tokens_per_step")
    virtual_batches_per_step = _builder_field("virtual_batches_per_step")
    peak_virtual_batches = _builder_field("peak_virtual_batches")
    step_virtual_batches = _builder_field("step_virtual_batches")
    capture = _builder_field("capture")
    capture_last_only = _builder_field("capture_last_only")
    capturing = _builder_field("capturing")

    def launch(self, batch: ScheduledBatch, prev: LaunchedStep | None = None) -> LaunchedStep:
        raise NotImplementedError

    def run(self, batch: ScheduledBatch) -> StepOutput:
        """One forward step; the chosen tokens of each request (empty when none)."""
        return self.collect(self.launch(batch))

    def collect(self, launched: LaunchedStep) -> StepOutput:
        """Wait for a launched step's tokens (only that step's copies, not later work)."""
        sample, bounds = launched.sample.result(), launched.row_bounds
        tokens = sample.tokens
        return StepOutput([tokens[bounds[i]:bounds[i + 1]] for i in range(bounds.shape[0] - 1)],
                          sample, bounds)


class ModelRunner(StepRunner):
    def __init__(self, model, block_manager: BlockManager, kind_to_group: dict[Kind, int],
                 backends: list, device, kv_dtype, seed: int = 0, chunk_size=None):
        self.model = model
        self.builder = InputBuilder(block_manager, chunk_size)
        self.groups = block_manager.groups
        self.kind_to_group = kind_to_group
        self.backends = backends  # one per KV group
        self.device = torch.device(device)
        self.block_size = self.groups[0].block_size
        self.sampler = Sampler(self.device, seed)
        #: Rows of captured logits computed at once (None: all of a step's).  The engine sets
        #: its max_num_seqs, the rows whose logits the memory profile's step held: a step of
        #: max_num_batched_tokens prompt rows would otherwise hold [tokens, vocab] float32
        #: logits at once (6.6 GB for 8192 of Scout's), beyond what the KV sizing reserved.
        self.capture_rows_per_pass: int | None = None
        #: calculate_kv_scales: the next step runs eagerly and sets every layer's FP8 KV
        #: scales from its own K and V before writing them; CUDA graphs, captured with the
        #: old scales, are captured again.
        self.kv_calibration_pending = False
        self._graph_args: tuple = ()
        self.graphs: CudaGraphs | None = None
        self.graph_steps = 0
        #: Steps no whole-forward graph covers, in segments (CHUNKLOCAL_PIECEWISE_GRAPHS=1).
        self.piecewise: piecewise_graphs.PiecewiseGraphs | None = None
        self.piecewise_steps = 0
        self._bind_caches(kv_dtype)

    @property
    def overlaps_eager(self) -> bool:
        """Every group's backend lets an eager step's successor launch before it is
        collected (``overlaps_eager_steps`` in backends/base.py; undeclared: no)."""
        return all(getattr(b, "overlaps_eager_steps", False) for b in self.backends)

    def enable_cuda_graphs(self, batch_sizes, query_lens, recorder=None,
                           max_tokens: int | None = None) -> None:
        """Whole-forward graphs for decode and verify steps; with ``max_tokens`` (the
        engine's max_num_batched_tokens) and the switch on, piecewise graphs for the
        other steps up to that many tokens."""
        self._graph_args = (batch_sizes, query_lens, recorder)
        self._capture_whole_graphs()
        if (max_tokens and piecewise_graphs.PIECEWISE_ENABLED
                and piecewise_graphs.supports(self.model)):
            self.piecewise = piecewise_graphs.PiecewiseGraphs(
                self.model, piecewise_graphs.largest_bucket(max_tokens), self.device, recorder)

    def _capture_whole_graphs(self) -> None:
        batch_sizes, query_lens, recorder = self._graph_args
        self.graphs = CudaGraphs(self.model, self.graph_steps_for,
                                 [grp.scratch_page * self.block_size for grp in self.groups],
                                 batch_sizes, query_lens, self.device, recorder)

    def graph_steps_for(self, batch_size: int, query_len: int, slot_mappings):
        """Steps a (B, q) graph captures: each backend's own capture metadata (all
        padding); replays refresh the same persistent metadata (``build_steps``)."""
        metadata = [backend.capture_step(batch_size, query_len) for backend in self.backends]
        return {kind: AttentionStep(self.backends[g], metadata[g], slot_mappings[g], kind)
                for kind, g in self.kind_to_group.items()}

    def _bind_caches(self, kv_dtype):
        for layer in self.model.layers:
            attn = layer.self_attn
            g = self.kind_to_group[attn.kind]
            shape = (self.groups[g].num_blocks + 1, self.block_size, attn.num_kv_heads,
                     attn.head_dim)
            dtype = self.groups[g].spec.dtype  # e4m3 pages: kv_cache_dtype="fp8"
            dtype = dtype if is_fp8(dtype) else kv_dtype
            attn.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)

    def build_steps(self, query_start_loc, seq_lens, tables, slot_mappings, *,
                    graph_batch_size: int | None = None) -> dict[Kind, AttentionStep]:
        """One ``backend.build()`` per KV group; every layer kind gets its group's metadata."""
        metadata = [backend.build(query_start_loc, seq_lens, table,
                                  graph_batch_size=graph_batch_size)
                    for backend, table in zip(self.backends, tables, strict=True)]
        return {kind: AttentionStep(self.backends[g], metadata[g], slot_mappings[g], kind)
                for kind, g in self.kind_to_group.items()}

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, prev: LaunchedStep | None = None) -> LaunchedStep:
        """Queue one step.  With ``prev`` (launched, not collected), input tokens that are
        still placeholders (-1: ``prev``'s own samples) are read from ``prev`` on the
        device, so this step needs no wait for ``prev`` (engine/overlap.py)."""
        host = self.builder.host_step(batch)
        inputs, tables = host.inputs, host.tables
        slots = [to_device(slot, self.device) for slot in host.slots]
        layout = None
        if self.graphs is not None and not self.kv_calibration_pending:
            layout = self.graphs.layout_for(np.diff(inputs.query_start_loc), inputs.num_drafts)
        input_ids = to_device(inputs.input_ids, self.device)
        holes = np.flatnonzero(inputs.input_ids < 0) if prev is not None else ()
        if len(holes) and prev is not None:
            owner = np.searchsorted(inputs.query_start_loc, holes, side="right") - 1
            src = np.fromiter((batch.seqs[i].placeholder_row for i in owner), np.int64,
                              owner.shape[0])
            input_ids[to_device(holes, self.device)] = \
                prev.sample.tokens_dev[to_device(src, self.device)]
        hidden = self.forward(inputs, tables, slots, input_ids, layout)
        if host.capture_rows is not None:
            rows = host.capture_rows
            step = self.capture_rows_per_pass or len(rows)
            index = torch.from_numpy(rows).to(self.device)
            logits = torch.cat([self.logits(hidden[index[i:i + step]]).cpu()
                                for i in range(0, len(rows), step)])
            self.builder.store_captured(batch.seqs, inputs, rows, logits)
        rows = hidden[to_device(inputs.logit_rows, self.device)]
        sample = self.sampler.launch(self.logits(rows), batch.seqs, inputs.logit_owner)
        bounds = inputs.row_bounds()
        return LaunchedStep(batch, sample, bounds, layout is not None or self.overlaps_eager)

    def forward(self, inputs: StepInputs, tables, slots, input_ids, layout):
        """Hidden states of every token (``slots``, ``input_ids``: on the device)."""
        steps = self.build_steps(inputs.query_start_loc, inputs.seq_lens, tables, slots,
                                 graph_batch_size=layout[0] if layout else None)
        if self.kv_calibration_pending:  # launch / execute chose no graph for this step
            return self._calibrating_forward(input_ids, inputs, steps)
        if layout is not None and self.graphs is not None:
            self.graph_steps += 1
            return self.graphs.replay(layout, input_ids, inputs.positions, slots)
        if self.piecewise is not None and self.piecewise.bucket_for(input_ids.shape[0]):
            self.piecewise_steps += 1
            return self.piecewise.run(input_ids, inputs.positions, steps)
        return self.model(input_ids, to_device(inputs.positions, self.device), steps)

    def _calibrating_forward(self, input_ids, inputs: StepInputs, steps):
        """The first real step with calculate_kv_scales, eager whatever its shape (the
        engine's first page writes use the new scales), then the graphs again."""
        layers = [layer.self_attn for layer in self.model.layers]
        for attn in layers:
            attn.calibrate_kv = True
        hidden = self.model(input_ids, to_device(inputs.positions, self.device), steps)
        self.kv_calibration_pending = False
        # Only the whole-forward graphs hold the scales (in their KV writes); piecewise
        # segments hold none (the KV writes between them run eagerly) and are kept.
        self.recapture_graphs()
        return hidden

    def recapture_graphs(self) -> None:
        """Capture the whole-forward CUDA graphs again (none made: nothing to do), after
        something they captured changed: the KV scales, or a kernel switch read when a
        kernel runs (benchmarks/switch_ab.py).  The old graphs' pool goes first."""
        if self.graphs is not None:
            self.graphs = None
            gc.collect()
            self._capture_whole_graphs()

    def logits(self, hidden):
        return self.model.compute_logits(hidden).float()
