"""The host half of a step: a scheduled batch becomes the model's inputs.

:class:`InputBuilder` turns a :class:`ScheduledBatch` into flat ``input_ids`` /
``positions``, the rows whose logits choose tokens, and, per KV group, one block table and
one slot mapping (numpy): everything a step needs before the device runs.  It also keeps
the steps' statistics and the prompt-logit capture state.  One engine process uses it
through :class:`~chunklocal.engine.model_runner.ModelRunner`; a tensor-parallel engine
through :class:`~chunklocal.engine.tp_runner.RemoteRunner`, which sends what it builds to
every rank.  Host arrays only: the same whoever runs the step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import chain

import numpy as np

from chunklocal._validate import cdiv
from chunklocal.engine.block_manager import BlockManager
from chunklocal.engine.scheduler import ScheduledBatch
from chunklocal.virtual_batches import virtual_batches_per_request

#: Steps whose statistics the builder keeps (a server runs for ever: bounded).
STEP_HISTORY = 1 << 16


@dataclass
class StepInputs:
    input_ids: np.ndarray       # [T]
    positions: np.ndarray       # [T]
    query_start_loc: np.ndarray  # [N+1]
    seq_lens: np.ndarray        # [N]
    logit_rows: np.ndarray      # rows whose logits choose tokens
    logit_owner: np.ndarray     # request of each logit row
    num_drafts: np.ndarray      # [N] speculative tokens per request

    def row_bounds(self) -> np.ndarray:
        """[N+1]: request i's sampled rows are ``row_bounds[i]:row_bounds[i + 1]`` of the
        step's logit rows (``logit_owner`` is sorted)."""
        return np.searchsorted(self.logit_owner, np.arange(len(self.seq_lens) + 1))


@dataclass
class HostStep:
    """One step's host-built inputs (numpy only)."""

    inputs: StepInputs
    tables: list                # [N, W] int32 block table per KV group
    slots: list                 # [T] int64 flat cache row of each token, per KV group
    capture_rows: np.ndarray | None  # token rows whose logits are captured (None: none)


class InputBuilder:
    def __init__(self, block_manager: BlockManager, chunk_size: int | None = None):
        self.block_manager = block_manager
        self.groups = block_manager.groups
        self.block_size = self.groups[0].block_size
        self.chunk_size = chunk_size
        self.peak_virtual_batches = 0
        #: The latest STEP_HISTORY steps, oldest first.
        self.virtual_batches_per_step: deque[int] = deque(maxlen=STEP_HISTORY)
        self.tokens_per_step: deque[int] = deque(maxlen=STEP_HISTORY)
        self.step_virtual_batches = 0  # of the latest step
        #: When a dict, every step stores the logits of every prompt position there, by
        #: request id, for every request; ``capture_last_only`` keeps just each prompt's
        #: last position.  Requests with ``seq.capture`` set (LLM.prompt_logits) get theirs
        #: in ``seq.captured`` instead; ``capturing`` counts them (the engine core keeps
        #: it), so other steps skip the check.
        self.capture: dict | None = None
        self.capture_last_only = False
        self.capturing = 0

    def host_step(self, batch: ScheduledBatch) -> HostStep:
        """Everything the host builds for one step, its statistics counted."""
        inputs = self.prepare(batch)
        self.tokens_per_step.append(int(inputs.query_start_loc[-1]))
        self._count_virtual_batches(inputs)
        tables, slots = self.group_inputs(batch, inputs)
        rows = None
        if self.capture is not None or self.capturing:
            rows = self.capture_rows(batch.seqs, inputs)
        return HostStep(inputs, tables, slots, rows)

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

    def group_inputs(self, batch: ScheduledBatch, inputs: StepInputs):
        """Block table and slot mapping (numpy) of every KV group."""
        row_of_token = np.repeat(np.arange(len(batch.seqs)), np.diff(inputs.query_start_loc))
        width = max(1, int(cdiv(inputs.seq_lens.max(), self.block_size)))
        rows = np.fromiter((s.row for s in batch.seqs), np.int64, len(batch.seqs))
        tables, slots = [], []
        for g in range(len(self.groups)):
            table = self.block_manager.table_rows(rows, g, width)
            pages = table[row_of_token, inputs.positions // self.block_size].astype(np.int64)
            tables.append(table)
            slots.append(pages * self.block_size + inputs.positions % self.block_size)
        return tables, slots

    def capture_rows(self, seqs, inputs: StepInputs) -> np.ndarray | None:
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

    def store_captured(self, seqs, inputs: StepInputs, rows, logits) -> None:
        """Hand each request its captured logits (``logits``: one per row of ``rows``)."""
        import torch

        owner = np.searchsorted(inputs.query_start_loc, rows, side="right") - 1
        for i in np.unique(owner):
            seq = seqs[int(i)]
            part = logits[torch.from_numpy(owner == i)]
            if self.capture is None:
                seq.captured.append(part)
            else:
                self.capture.setdefault(seq.seq_id, []).append(part)
