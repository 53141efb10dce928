"""Turn a scheduled batch into model inputs, run one step, pick the next tokens.

Per step the runner builds flat ``input_ids`` / ``positions``, and for every KV
group one block table, one slot mapping and exactly one ``backend.build()``,
whose metadata all the group's layers share.  Hybrid mode: chunked layers read
the chunked group, global layers the global group.  Merged mode: both kinds read
the single group (the one build prepares both).  This is the only place a batch
becomes attention metadata: decode and verify steps that replay a CUDA graph
(engine/cuda_graphs.py) get theirs from the same ``build_steps``.

A step has a host half and a device half: :meth:`ModelRunner.host_step` turns the
scheduled batch into a :class:`DeviceStep` of numpy arrays, :meth:`ModelRunner.execute`
runs it (metadata, forward, sampling).  With tensor parallelism the host half runs
once, in the caller's process, and every rank executes the same DeviceStep
(engine/workers.py), building its own metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from chunklocal._validate import cdiv
from chunklocal.backends.base import AttentionStep, Kind
from chunklocal.engine.block_manager import BlockManager
from chunklocal.engine.scheduler import ScheduledBatch
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
class DeviceStep:
    """Everything a rank needs to run one step: numpy only (tensor-parallel workers get
    it pickled).  Attention metadata is not in it: each rank builds its own."""

    inputs: StepInputs
    tables: list            # [N, W] int32 block table per KV group
    slots: list             # [T] int64 flat cache row of each token, per KV group
    temperatures: np.ndarray  # per logit row
    capture_rows: np.ndarray | None  # token rows whose float32 logits execute() returns


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
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.peak_virtual_batches = 0
        self.virtual_batches_per_step: list[int] = []
        self.tokens_per_step: list[int] = []
        #: When a dict, run() stores the logits of every prompt position there,
        #: by request id (see LLM.prompt_logits); ``capture_last_only`` keeps
        #: just each prompt's last position.
        self.capture: dict | None = None
        self.capture_last_only = False
        self.graphs = None
        self.graph_steps = 0
        if model is not None:  # None: the host half of a tensor-parallel engine
            self._bind_caches(kv_dtype)

    def enable_cuda_graphs(self, batch_sizes, query_lens) -> None:
        from chunklocal.engine.cuda_graphs import CudaGraphs

        self.graphs = CudaGraphs(self.model, self.graph_steps_for,
                                 [grp.scratch_page * self.block_size for grp in self.groups],
                                 batch_sizes, query_lens, self.device)

    def graph_steps_for(self, batch_size: int, query_len: int, slot_mappings):
        """Steps a (B, q) graph captures: one dummy request reading only the scratch
        page selects the layout; replays refresh the same persistent metadata."""
        tables = [np.array([[grp.scratch_page]], dtype=np.int32) for grp in self.groups]
        return self.build_steps(np.array([0, query_len]), np.array([query_len]), tables,
                                slot_mappings, graph_batch_size=batch_size)

    def _bind_caches(self, kv_dtype):
        for layer in self.model.layers:
            attn = layer.self_attn
            g = self.kind_to_group[attn.kind]
            shape = (self.groups[g].num_blocks + 1, self.block_size, attn.num_kv_heads,
                     attn.head_dim)
            attn.k_cache = torch.zeros(shape, dtype=kv_dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=kv_dtype, device=self.device)

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        seqs = batch.seqs
        query_lens = np.asarray(batch.num_new, dtype=np.int64)
        starts = np.fromiter((s.num_computed for s in seqs), np.int64, len(seqs))
        qsl = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])
        positions = np.arange(num_tokens) + np.repeat(starts - qsl[:-1], query_lens)
        # One Python slice per request; the tokens themselves are copied in C.
        pieces = (s.token_ids[s.num_computed:s.num_computed + n - len(d)] + d
                  for s, n, d in zip(seqs, batch.num_new, batch.drafts, strict=True))
        input_ids = np.fromiter(chain.from_iterable(pieces), np.int64, num_tokens)
        seq_lens = starts + query_lens
        # Requests whose step reaches their last known token choose new tokens:
        # one row for prefill/decode, every row of a verify window.
        lengths = np.fromiter((len(s) for s in seqs), np.int64, len(seqs))
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

    def group_inputs(self, batch: ScheduledBatch, inputs: StepInputs):
        """Block table and slot mapping (numpy) of every KV group."""
        row_of_token = np.repeat(np.arange(len(batch.seqs)), np.diff(inputs.query_start_loc))
        width = max(1, int(cdiv(inputs.seq_lens.max(), self.block_size)))
        tables, slots = [], []
        for g in range(len(self.groups)):
            table = self.block_manager.table_rows(batch.seqs, g, width)
            pages = table[row_of_token, inputs.positions // self.block_size].astype(np.int64)
            slot = pages * self.block_size + inputs.positions % self.block_size
            tables.append(table)
            slots.append(slot)
        return tables, slots

    def build_steps(self, query_start_loc, seq_lens, tables, slot_mappings, *,
                    graph_batch_size: int | None = None) -> dict[Kind, AttentionStep]:
        """One ``backend.build()`` per KV group; every layer kind gets its group's metadata."""
        metadata = [backend.build(query_start_loc, seq_lens, table,
                                  graph_batch_size=graph_batch_size)
                    for backend, table in zip(self.backends, tables, strict=True)]
        return {kind: AttentionStep(self.backends[g], metadata[g], slot_mappings[g], kind)
                for kind, g in self.kind_to_group.items()}

    def run(self, batch: ScheduledBatch, temperatures: np.ndarray) -> list[np.ndarray]:
        """One forward step; the chosen tokens of each request (empty when none)."""
        step = self.host_step(batch, temperatures)
        tokens, logits = self.execute(step)
        if logits is not None:
            self._store_captured(batch, step, logits)
        bounds = np.searchsorted(step.inputs.logit_owner, np.arange(len(batch.seqs) + 1))
        return [tokens[bounds[i]:bounds[i + 1]] for i in range(len(batch.seqs))]

    def host_step(self, batch: ScheduledBatch, temperatures: np.ndarray) -> DeviceStep:
        inputs = self.prepare(batch)
        self.tokens_per_step.append(int(inputs.query_start_loc[-1]))
        self._count_virtual_batches(inputs)
        tables, slots = self.group_inputs(batch, inputs)
        capture_rows = None
        if self.capture is not None:
            prompt_len = np.repeat([s.num_prompt_tokens for s in batch.seqs],
                                   np.diff(inputs.query_start_loc))
            keep = inputs.positions < prompt_len
            if self.capture_last_only:
                keep &= inputs.positions == prompt_len - 1
            capture_rows = np.flatnonzero(keep)
        return DeviceStep(inputs, tables, slots, temperatures[inputs.logit_owner], capture_rows)

    @torch.inference_mode()
    def execute(self, step: DeviceStep):
        """(chosen tokens per logit row, float32 CPU logits of ``capture_rows`` or None)."""
        inputs = step.inputs
        slots = [torch.from_numpy(slot).to(self.device) for slot in step.slots]
        layout = None
        if self.graphs is not None:
            layout = self.graphs.layout_for(np.diff(inputs.query_start_loc), inputs.num_drafts)
        steps = self.build_steps(inputs.query_start_loc, inputs.seq_lens, step.tables, slots,
                                 graph_batch_size=layout[0] if layout else None)
        if layout is not None:
            hidden = self.graphs.replay(layout, inputs.input_ids, inputs.positions, slots)
            self.graph_steps += 1
        else:
            hidden = self.model(torch.from_numpy(inputs.input_ids).to(self.device),
                                torch.from_numpy(inputs.positions).to(self.device), steps)
        logits = None
        if step.capture_rows is not None and step.capture_rows.size:
            rows = torch.from_numpy(step.capture_rows).to(self.device)
            logits = self.logits(hidden[rows]).cpu()
        tokens = self.sample(hidden[torch.from_numpy(inputs.logit_rows).to(self.device)],
                             step.temperatures)
        return tokens, logits

    def _store_captured(self, batch, step: DeviceStep, logits):
        owner = np.searchsorted(step.inputs.query_start_loc, step.capture_rows, side="right") - 1
        for i in np.unique(owner):
            seq = batch.seqs[int(i)]
            self.capture.setdefault(seq.seq_id, []).append(logits[torch.from_numpy(owner == i)])

    def logits(self, hidden):
        return self.model.compute_logits(hidden).float()

    def sample(self, hidden, temperatures: np.ndarray) -> np.ndarray:
        if hidden.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        logits = self.logits(hidden)
        greedy = logits.argmax(dim=-1)
        if not (temperatures > 0).any():
            return greedy.cpu().numpy()
        temp = torch.from_numpy(np.maximum(temperatures, 1e-6)).to(logits)
        probs = torch.softmax(logits / temp[:, None], dim=-1)
        drawn = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        chosen = torch.where(torch.from_numpy(temperatures > 0).to(logits.device), drawn, greedy)
        return chosen.cpu().numpy()
