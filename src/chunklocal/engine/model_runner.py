"""Turn a scheduled batch into model inputs, run one step, pick the next tokens.

Per step the runner builds flat ``input_ids`` / ``positions``, and for every KV
group one block table, one slot mapping and exactly one ``backend.build()``,
whose metadata all the group's layers share.  Hybrid mode: chunked layers read
the chunked group, global layers the global group.  Merged mode: both kinds read
the single group (the one build prepares both).  This is the only place a batch
becomes attention metadata: decode and verify steps that replay a CUDA graph
(engine/cuda_graphs.py) get theirs from the same ``build_steps``.

With tensor parallelism (engine/tp_runner.py) the host half of :meth:`launch`
(``prepare``, ``group_inputs``, ``capture_rows``) runs once in the caller's process and
every rank runs :meth:`forward` on the same inputs; rank 0 samples with its
:class:`Sampler`.
"""

from __future__ import annotations

import gc
from collections import deque
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from chunklocal._validate import cdiv
from chunklocal.backends.base import AttentionStep, Kind
from chunklocal.engine.block_manager import BlockManager
from chunklocal.engine.cuda_graphs import CudaGraphs
from chunklocal.engine.sampler import DeviceSample, Sampler, SampleResult, to_device
from chunklocal.engine.scheduler import ScheduledBatch
from chunklocal.kv_quant import is_fp8
from chunklocal.virtual_batches import virtual_batches_per_request


@dataclass
class StepInputs:
    input_ids: np.ndarray       # [T]
    positions: np.ndarray       # [T]
    query_start_loc: np.ndarray  # [N+1]
    seq_lens: np.ndarray        # [N]
    logit_rows: np.ndarray      # rows whose logits choose tokens
    logit_owner: np.ndarray     # request of each logit row
    num_drafts: np.ndarray      # [N] speculative tokens per request


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
    used_graph: bool            # replayed a CUDA graph (no FlashInfer plan() staging)
    step: int = 0               # the engine core's step number


#: Steps whose statistics the runner keeps (a server runs for ever: bounded).
STEP_HISTORY = 1 << 16


class ModelRunner:
    def __init__(self, model, block_manager: BlockManager, kind_to_group: dict[Kind, int],
                 backends: list, device, kv_dtype, seed: int = 0, chunk_size=None):
        self.model = model
        self.block_manager = block_manager
        self.groups = block_manager.groups
        self.kind_to_group = kind_to_group
        self.backends = backends  # one per KV group
        self.chunk_size = chunk_size
        self.device = torch.device(device)
        self.block_size = self.groups[0].block_size
        self.sampler = Sampler(self.device, seed)
        self.peak_virtual_batches = 0
        #: The latest STEP_HISTORY steps, oldest first.
        self.virtual_batches_per_step: deque[int] = deque(maxlen=STEP_HISTORY)
        self.tokens_per_step: deque[int] = deque(maxlen=STEP_HISTORY)
        self.step_virtual_batches = 0  # of the latest step
        #: When a dict, run() stores the logits of every prompt position there,
        #: by request id, for every request; ``capture_last_only`` keeps
        #: just each prompt's last position.  Requests with ``seq.capture`` set
        #: (LLM.prompt_logits) get theirs in ``seq.captured`` instead; ``capturing``
        #: counts them (the engine core keeps it), so other steps skip the check.
        self.capture: dict | None = None
        self.capture_last_only = False
        self.capturing = 0
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
        if model is not None:  # None: the host half of a tensor-parallel engine
            self._bind_caches(kv_dtype)

    def enable_cuda_graphs(self, batch_sizes, query_lens, recorder=None) -> None:
        self._graph_args = (batch_sizes, query_lens, recorder)
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

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        seqs = batch.seqs
        query_lens = np.asarray(batch.num_new, dtype=np.int64)
        starts = np.fromiter((s.num_computed for s in seqs), np.int64, len(seqs))
        qsl = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])
        positions = np.arange(num_tokens) + np.repeat(starts - qsl[:-1], query_lens)
        if num_tokens == len(seqs):  # one token each: no slices (no drafts either)
            input_ids = np.fromiter((s.token_ids[s.num_computed] for s in seqs), np.int64,
                                    num_tokens)
        else:  # one Python slice per request; the tokens themselves are copied in C
            pieces = (s.token_ids[s.num_computed:s.num_computed + n - len(d)] + d
                      for s, n, d in zip(seqs, batch.num_new, batch.drafts, strict=True))
            input_ids = np.fromiter(chain.from_iterable(pieces), np.int64, num_tokens)
        seq_lens = starts + query_lens
        # Requests whose step reaches their last known token choose new tokens:
        # one row for prefill/decode, every row of a verify window.
        lengths = np.fromiter((len(s.token_ids) for s in seqs), np.int64, len(seqs))
        num_draft = np.fromiter((len(d) for d in batch.drafts), np.int64, len(seqs))
        rows_per_seq = np.where(seq_lens - num_draft >= lengths, num_draft + 1, 0)
        logit_owner = np.repeat(np.arange(len(seqs)), rows_per_seq)
        first_row = np.cumsum(rows_per_seq) - rows_per_seq
        offset = np.arange(logit_owner.shape[0]) - first_row[logit_owner]
        logit_rows = qsl[1:][logit_owner] - rows_per_seq[logit_owner] + offset
        return StepInputs(input_ids, positions, qsl.astype(np.int32),
                          seq_lens.astype(np.int32), logit_rows, logit_owner, num_draft)

    def _count_virtual_batches(self, inputs: StepInputs) -> None:
        if not self.chunk_size:
            return
        # Virtual batches of the step (a statistic; each backend makes its own).
        count = int(virtual_batches_per_request(np.diff(inputs.query_start_loc),
                                                inputs.seq_lens, self.chunk_size).sum())
        self.peak_virtual_batches = max(self.peak_virtual_batches, count)
        self.virtual_batches_per_step.append(count)
        self.step_virtual_batches = count

    def group_inputs(self, batch: ScheduledBatch, inputs: StepInputs, on_device=True):
        """Block table (numpy) and slot mapping (device, or numpy) of every KV group."""
        row_of_token = np.repeat(np.arange(len(batch.seqs)), np.diff(inputs.query_start_loc))
        width = max(1, int(cdiv(inputs.seq_lens.max(), self.block_size)))
        rows = np.fromiter((s.row for s in batch.seqs), np.int64, len(batch.seqs))
        tables, slots = [], []
        for g in range(len(self.groups)):
            table = self.block_manager.table_rows(rows, g, width)
            pages = table[row_of_token, inputs.positions // self.block_size].astype(np.int64)
            slot = pages * self.block_size + inputs.positions % self.block_size
            tables.append(table)
            slots.append(to_device(slot, self.device) if on_device else slot)
        return tables, slots

    def build_steps(self, query_start_loc, seq_lens, tables, slot_mappings, *,
                    graph_batch_size: int | None = None) -> dict[Kind, AttentionStep]:
        """One ``backend.build()`` per KV group; every layer kind gets its group's metadata."""
        metadata = [backend.build(query_start_loc, seq_lens, table,
                                  graph_batch_size=graph_batch_size)
                    for backend, table in zip(self.backends, tables, strict=True)]
        return {kind: AttentionStep(self.backends[g], metadata[g], slot_mappings[g], kind)
                for kind, g in self.kind_to_group.items()}

    def run(self, batch: ScheduledBatch) -> StepOutput:
        """One forward step; the chosen tokens of each request (empty when none)."""
        return self.collect(self.launch(batch))

    def collect(self, launched: LaunchedStep) -> StepOutput:
        """Wait for a launched step's tokens (only that step's copies, not later work)."""
        sample, bounds = launched.sample.result(), launched.row_bounds
        tokens = sample.tokens
        return StepOutput([tokens[bounds[i]:bounds[i + 1]] for i in range(bounds.shape[0] - 1)],
                          sample, bounds)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, prev: LaunchedStep | None = None) -> LaunchedStep:
        """Queue one step.  With ``prev`` (launched, not collected), input tokens that are
        still placeholders (-1: ``prev``'s own samples) are read from ``prev`` on the
        device, so this step needs no wait for ``prev`` (engine/overlap.py)."""
        inputs = self.prepare(batch)
        self.tokens_per_step.append(int(inputs.query_start_loc[-1]))
        self._count_virtual_batches(inputs)
        tables, slots = self.group_inputs(batch, inputs)
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
        if self.capture is not None or self.capturing:
            rows = self.capture_rows(batch.seqs, inputs)
            if rows is not None:
                step = self.capture_rows_per_pass or len(rows)
                index = torch.from_numpy(rows).to(self.device)
                logits = torch.cat([self.logits(hidden[index[i:i + step]]).cpu()
                                    for i in range(0, len(rows), step)])
                self.store_captured(batch.seqs, inputs, rows, logits)
        rows = hidden[to_device(inputs.logit_rows, self.device)]
        sample = self.sampler.launch(self.logits(rows), batch.seqs, inputs.logit_owner)
        bounds = np.searchsorted(inputs.logit_owner, np.arange(len(batch.seqs) + 1))
        return LaunchedStep(batch, sample, bounds, layout is not None)

    def forward(self, inputs: StepInputs, tables, slots, input_ids, layout):
        """Hidden states of every token (``slots``, ``input_ids``: on the device)."""
        steps = self.build_steps(inputs.query_start_loc, inputs.seq_lens, tables, slots,
                                 graph_batch_size=layout[0] if layout else None)
        if self.kv_calibration_pending:  # launch / execute chose no graph for this step
            return self._calibrating_forward(input_ids, inputs, steps)
        if layout is not None and self.graphs is not None:
            self.graph_steps += 1
            return self.graphs.replay(layout, input_ids, inputs.positions, slots)
        return self.model(input_ids, to_device(inputs.positions, self.device), steps)

    def _calibrating_forward(self, input_ids, inputs: StepInputs, steps):
        """The first real step with calculate_kv_scales, eager whatever its shape (the
        engine's first page writes use the new scales), then the graphs again."""
        layers = [layer.self_attn for layer in self.model.layers]
        for attn in layers:
            attn.calibrate_kv = True
        hidden = self.model(input_ids, to_device(inputs.positions, self.device), steps)
        self.kv_calibration_pending = False
        if self.graphs is not None:  # the old graphs' pool goes before the new one is made
            self.graphs = None
            gc.collect()
            self.enable_cuda_graphs(*self._graph_args)
        return hidden

    def capture_rows(self, seqs, inputs) -> np.ndarray | None:
        """Token rows whose logits are captured this step (None when none)."""
        if self.capture is None:
            mode = [s.capture for s in seqs]
        else:
            mode = ["last" if self.capture_last_only else "all"] * len(seqs)
        per_token = np.diff(inputs.query_start_loc)
        prompt_len = np.repeat([s.num_prompt_tokens for s in seqs], per_token)
        last_only = np.repeat([m == "last" for m in mode], per_token)
        keep = (inputs.positions < prompt_len) & np.repeat([m is not None for m in mode],
                                                           per_token)
        keep &= ~last_only | (inputs.positions == prompt_len - 1)
        rows = np.flatnonzero(keep)
        return rows if rows.size else None

    def store_captured(self, seqs, inputs, rows, logits):
        owner = np.searchsorted(inputs.query_start_loc, rows, side="right") - 1
        for i in np.unique(owner):
            seq = seqs[int(i)]
            part = logits[torch.from_numpy(owner == i)]
            if self.capture is None:
                seq.captured.append(part)
            else:
                self.capture.setdefault(seq.seq_id, []).append(part)

    def logits(self, hidden):
        return self.model.compute_logits(hidden).float()
