"""CUDA graphs for decode and speculative-verify steps: capture and replay only.

One graph per (batch size B, query length q): q = 1 for decode, q = k + 1 for
verify windows.  Each captures the whole model forward over B * q static token
rows.  The attention metadata lives in the backends' persistent buffers; the
model runner refreshes them (``backend.build(..., graph_batch_size=B)``) before
each replay, so this module never builds metadata: capture takes its steps from
the runner's ``make_steps`` and replay only copies the static inputs.

Padding rows (batch padded up to B) carry token 0 at position 0, write their K/V
to the group's reserved scratch page and read only that page: no real KV is
touched, and their outputs are dropped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch


class Replayable(Protocol):
    def replay(self) -> None: ...


class GraphRecorder(Protocol):
    """How graphs are recorded: torch.cuda's (:class:`CudaGraphRecorder`), or a
    recorder a test injects to run the capture and replay logic on the CPU."""

    def new_pool(self) -> Any:
        """A memory pool the engine's graphs share."""

    def record(self, forward: Callable[[], torch.Tensor],
               pool: Any) -> tuple[Replayable, torch.Tensor]:
        """Capture ``forward`` (static inputs -> static output): (graph, output)."""


class CudaGraphRecorder:
    """torch.cuda graphs on one device, on one capture stream for all its graphs.

    torch's default capture stream is made once, on whichever device was current then:
    kernels of another device would not be captured.  One stream for all, so the graphs
    share the pool's blocks; "thread_local" so another engine's loop thread may sync
    meanwhile."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.stream: torch.cuda.Stream | None = None  # made on the first capture

    def new_pool(self):
        return torch.cuda.graph_pool_handle()

    def record(self, forward, pool):
        torch.cuda.synchronize(self.device)
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=self.stream,
                              capture_error_mode="thread_local"):
            output = forward()
        return graph, output


class CudaGraphs:
    """``make_steps(batch_size, query_len, slot_mappings)`` returns the steps a
    (B, q) graph captures; ``scratch_slots[g]`` is group g's padding cache row;
    ``recorder`` records them (None: :class:`CudaGraphRecorder` on ``device``)."""

    def __init__(self, model, make_steps, scratch_slots, batch_sizes, query_lens, device,
                 recorder: GraphRecorder | None = None):
        self.model, self.make_steps, self.device = model, make_steps, device
        self.recorder: GraphRecorder = (CudaGraphRecorder(device) if recorder is None
                                        else recorder)
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.query_lens = tuple(query_lens)
        rows = max(self.batch_sizes) * max(self.query_lens)
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.scratch_slots = [int(s) for s in scratch_slots]
        self.slots = [torch.full((rows,), s, dtype=torch.long, device=device)
                      for s in self.scratch_slots]
        self.graphs, self.outputs = {}, {}
        self.replays: Counter = Counter()  # (B, q) -> replays
        self.padding_rows = 0
        pool = self.recorder.new_pool()
        for q in self.query_lens:
            for b in reversed(self.batch_sizes):  # largest first: the pool fits the rest
                self._capture(b, q, pool)

    @torch.inference_mode()
    def _capture(self, batch_size: int, query_len: int, pool) -> None:
        rows = batch_size * query_len
        steps = self.make_steps(batch_size, query_len, [s[:rows] for s in self.slots])

        def forward():
            return self.model(self.input_ids[:rows], self.positions[:rows], steps)

        forward()  # warm-up: lazy kernel setup happens outside the capture
        graph, output = self.recorder.record(forward, pool)
        self.graphs[batch_size, query_len], self.outputs[batch_size, query_len] = graph, output

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

    def replay(self, layout, input_ids, positions: np.ndarray,
               slot_mappings) -> torch.Tensor:
        """Copy one step's inputs into the static buffers (padding the rest) and replay.
        ``input_ids``: a numpy array, or the step's tokens already on the device (an
        overlapped step reads its placeholders from the step before it there)."""
        batch_size, query_len = layout
        rows = input_ids.shape[0]
        padded = batch_size * query_len
        if isinstance(input_ids, np.ndarray):
            input_ids = torch.from_numpy(input_ids)
        self.input_ids[:rows].copy_(input_ids, non_blocking=True)
        self.positions[:rows].copy_(torch.from_numpy(positions), non_blocking=True)
        self.input_ids[rows:padded].zero_()
        self.positions[rows:padded].zero_()
        for static, slots, scratch in zip(self.slots, slot_mappings, self.scratch_slots,
                                          strict=True):
            static[:rows].copy_(slots, non_blocking=True)
            static[rows:padded].fill_(scratch)
        self.graphs[batch_size, query_len].replay()
        self.replays[batch_size, query_len] += 1
        self.padding_rows += padded - rows
        return self.outputs[batch_size, query_len][:rows]
