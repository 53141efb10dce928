"""CUDA graphs for decode and speculative-verify steps.

One graph per (batch size B, query length q): q = 1 for decode, q = k + 1 for
verify windows.  Each captures the whole model forward over B * q static token
rows; the attention metadata lives in the backend's persistent buffers
(``backend.build(..., graph_batch_size=B)`` refreshes them on the host before
each replay, see backends/flashinfer.py), so the graph itself does no host work.

Padding rows (batch padded up to B) carry token 0 at position 0, write their K/V
to the group's reserved scratch page and read only that page: no real KV is
touched, and their outputs are dropped.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from chunklocal.models.llama4 import CHUNKED, AttentionStep


class CudaGraphs:
    def __init__(self, model, backends, kind_to_group, scratch_pages, block_size: int,
                 batch_sizes, query_lens, device):
        self.model, self.backends, self.kind_to_group = model, backends, kind_to_group
        self.block_size, self.device = block_size, device
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.query_lens = tuple(query_lens)
        rows = max(self.batch_sizes) * max(self.query_lens)
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.scratch_slots = [int(p) * block_size for p in scratch_pages]
        self.slots = [torch.full((rows,), s, dtype=torch.long, device=device)
                      for s in self.scratch_slots]
        self.graphs, self.outputs = {}, {}
        self.replays: Counter = Counter()  # (B, q) -> replays
        self.padding_rows = 0
        pool = self._new_pool()
        for q in self.query_lens:
            for b in reversed(self.batch_sizes):  # largest first: the pool fits the rest
                self._capture(b, q, pool)

    def _steps(self, metadata, rows):
        return {kind: AttentionStep(self.backends[g], metadata[g], self.slots[g][:rows],
                                    chunked=kind == CHUNKED)
                for kind, g in self.kind_to_group.items()}

    @torch.inference_mode()
    def _capture(self, batch_size: int, query_len: int, pool) -> None:
        rows = batch_size * query_len
        # One dummy request reading only the scratch page selects the (B, q) layout.
        metadata = [backend.build(np.array([0, query_len]), np.array([query_len]),
                                  np.array([[scratch // self.block_size]]),
                                  graph_batch_size=batch_size)
                    for backend, scratch in zip(self.backends, self.scratch_slots, strict=True)]
        steps = self._steps(metadata, rows)

        def forward():
            return self.model(self.input_ids[:rows], self.positions[:rows], steps)

        forward()  # warm-up: lazy kernel setup happens outside the capture
        graph, output = self._record(forward, pool)
        self.graphs[batch_size, query_len], self.outputs[batch_size, query_len] = graph, output

    # The two CUDA-specific hooks (tests replace them to run this logic on the CPU).
    def _new_pool(self):
        return torch.cuda.graph_pool_handle()

    def _record(self, forward, pool):
        """Capture ``forward`` (static inputs -> static output); return (graph, output)."""
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = forward()
        return graph, output

    def layout_for(self, query_lens: np.ndarray, num_drafts: np.ndarray):
        """(B, q) for an all-decode / all-verify step with one query length, else None."""
        n = query_lens.shape[0]
        if n == 0 or n > self.batch_sizes[-1]:
            return None
        q = int(query_lens[0])
        if q not in self.query_lens or (query_lens != q).any() or (num_drafts != q - 1).any():
            return None
        b = self.batch_sizes[int(np.searchsorted(self.batch_sizes, n))]
        return b, q

    def run(self, layout, inputs, tables, slots, input_ids=None) -> torch.Tensor:
        """Replay for ``inputs`` (StepInputs); ``tables``/``slots`` per KV group.
        ``input_ids``: the step's tokens already on the device (else inputs.input_ids)."""
        batch_size, query_len = layout
        rows = inputs.input_ids.shape[0]
        padded = batch_size * query_len
        if input_ids is None:
            input_ids = torch.from_numpy(inputs.input_ids)
        self.input_ids[:rows].copy_(input_ids, non_blocking=True)
        self.positions[:rows].copy_(torch.from_numpy(inputs.positions), non_blocking=True)
        self.input_ids[rows:padded].zero_()
        self.positions[rows:padded].zero_()
        for g, backend in enumerate(self.backends):
            self.slots[g][:rows].copy_(slots[g], non_blocking=True)
            self.slots[g][rows:padded].fill_(self.scratch_slots[g])
            backend.build(inputs.query_start_loc, inputs.seq_lens, tables[g],
                          graph_batch_size=batch_size)
        self.graphs[batch_size, query_len].replay()
        self.replays[batch_size, query_len] += 1
        self.padding_rows += padded - rows
        return self.outputs[batch_size, query_len][:rows]
