"""Piecewise CUDA graphs for the steps no whole-forward graph covers (issue 20, item 3).

A step that mixes decodes with a prefill chunk, or a prefill alone, has a request layout
that no (B, q) graph of engine/cuda_graphs.py covers, so it would launch every kernel of
every layer from Python.  Everything between two attention calls depends only on the
step's token count T, not on how the tokens split into requests, so per bucket T
(``bounds.sizing.piecewise_buckets``) the model is captured as L + 1 segments:

* segment 0: the rope factors, the embedding and layer 0 up to its attention;
* segment i (1 <= i < L): layer i-1 after its attention, then layer i up to its attention;
* segment L: layer L-1 after its attention and the final norm.

Between two segments the layer's attention runs eagerly on the step's real rows with the
metadata built for the step as an eager step builds it (``Attention.attend``: the KV write
and the backend's forward).  docs/mixed-steps.md has the plan and the costs.

Invariants:

* Every tensor that crosses a segment boundary (q, k, v, the residual stream, the
  attention's output, the rope factors and query temperature, the final hidden states)
  lives in a static buffer sized for the largest bucket, written by the segment that makes
  it.  Nothing a segment allocates outlives its replay, so the segments of every bucket
  share one pool, which holds about one segment's activations.
* Padding rows (T padded up to its bucket) carry token 0 at position 0.  The attention
  never reads them (it takes rows [:n]); every other op is row-wise, so they cannot reach a
  real row, and their outputs are dropped.  Their attention output rows keep whatever an
  earlier step left there: finite values, read only by padding rows.
* Segments read no host state per step: the MoE routes on the device, and the kernels'
  tile choices depend on the static T.

Off by default until measured on a GPU (``CHUNKLOCAL_PIECEWISE_GRAPHS=1`` turns it on).
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import torch

from chunklocal.bounds.sizing import piecewise_buckets
from chunklocal.engine.cuda_graphs import CudaGraphRecorder, GraphRecorder
from chunklocal.models.llama4 import add_rms_norm

#: The switch, read at import (``CHUNKLOCAL_PIECEWISE_GRAPHS=1`` turns it on).
PIECEWISE_ENABLED = os.environ.get("CHUNKLOCAL_PIECEWISE_GRAPHS", "0") == "1"
#: The largest bucket (``CHUNKLOCAL_PIECEWISE_MAX_TOKENS``): longer steps run eagerly.  The
#: segments' static buffers and their pool are sized for the largest bucket, and capture
#: time grows with the bucket count, so buckets up to an 8,192-token budget cost full-size
#: Scout FP8 28.6 s of start-up and 13 of 291 sequences (BENCHMARKS.md, twelfth session).
#: Steps past 2,048 tokens carry a prefill chunk whose GEMMs keep the device busy while the
#: next step is built (overlapped eager steps), so their launches cost little; the serve
#: runs that measured the gain (sixteenth and seventeenth sessions) had no longer steps.
#: 0: no cap.  (vLLM caps its captured sizes too: ``max_capture_size``.)
MAX_TOKENS = int(os.environ.get("CHUNKLOCAL_PIECEWISE_MAX_TOKENS", "2048"))


def largest_bucket(max_num_batched_tokens: int) -> int:
    """The token count of the largest piecewise bucket for an engine's step budget."""
    return min(max_num_batched_tokens, MAX_TOKENS) if MAX_TOKENS else max_num_batched_tokens


def supports(model) -> bool:
    """The model splits at its attention calls (models/llama4.py) on one rank."""
    tp = getattr(model, "tp", None)
    return hasattr(model, "rope_inputs") and (tp is None or tp.size == 1)


class PiecewiseGraphs:
    """Segments of ``model`` captured at every bucket up to ``max_tokens`` by
    ``recorder`` (None: :class:`CudaGraphRecorder` on ``device``)."""

    def __init__(self, model, max_tokens: int, device,
                 recorder: GraphRecorder | None = None):
        self.model = model
        self.layers = list(model.layers)
        self.recorder: GraphRecorder = (CudaGraphRecorder(device) if recorder is None
                                        else recorder)
        self.buckets = piecewise_buckets(max_tokens)
        rows = self.buckets[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.buffers: dict[str, torch.Tensor] = {}
        self.graphs: dict[int, list] = {}
        self.replays: Counter = Counter()  # bucket -> steps
        self.padding_rows = 0
        pool = self.recorder.new_pool()
        for bucket in reversed(self.buckets):  # largest first: the pool fits the rest
            self._capture(bucket, pool)

    def bucket_for(self, tokens: int) -> int | None:
        """The smallest bucket holding ``tokens`` rows, or None past the largest."""
        i = int(np.searchsorted(self.buckets, tokens))
        return self.buckets[i] if 0 < tokens and i < len(self.buckets) else None

    # -- segments: static inputs -> static buffers -----------------------------------------

    def _store(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s rows into the static buffer ``name`` (made at the first, largest,
        warm-up); returns the buffer's view of them."""
        rows = tensor.shape[0]
        if name not in self.buffers:
            self.buffers[name] = torch.zeros(self.buckets[-1], *tensor.shape[1:],
                                             dtype=tensor.dtype, device=tensor.device)
        view = self.buffers[name][:rows]
        view.copy_(tensor)
        return view

    def _before(self, layer, h, residual, t: int) -> None:
        q_scale = self.buffers["q_scale"][:t] if "q_scale" in self.buffers else None
        q, k, v, residual = layer.before_attention(h, residual, q_scale,
                                                   self.buffers["freqs"][:t])
        for name, x in (("q", q), ("k", k), ("v", v), ("residual", residual)):
            self._store(name, x)
        if "attn_out" not in self.buffers:  # the attention's output: q's rows and dtype
            self.buffers["attn_out"] = torch.zeros(self.buckets[-1], q[0].numel(),
                                                   dtype=q.dtype, device=q.device)

    def _segment(self, index: int, t: int):
        def first():
            freqs, q_scale = self.model.rope_inputs(self.positions[:t])
            self._store("freqs", freqs)
            if q_scale is not None:
                self._store("q_scale", q_scale)
            h = self.model.model.embed_tokens(self.input_ids[:t])
            self._before(self.layers[0], h, None, t)
            return self.buffers["q"][:t]

        def middle():
            h, residual = self.layers[index - 1].after_attention(
                self.buffers["attn_out"][:t], self.buffers["residual"][:t])
            self._before(self.layers[index], h, residual, t)
            return self.buffers["q"][:t]

        def last():
            h, residual = self.layers[-1].after_attention(self.buffers["attn_out"][:t],
                                                          self.buffers["residual"][:t])
            return self._store("hidden", add_rms_norm(h, residual, self.model.model.norm)[0])

        return first if index == 0 else last if index == len(self.layers) else middle

    @torch.inference_mode()
    def _capture(self, bucket: int, pool) -> None:
        graphs = []
        for index in range(len(self.layers) + 1):
            segment = self._segment(index, bucket)
            segment()  # warm-up: lazy kernel setup (and the buffers) outside the capture
            graphs.append(self.recorder.record(segment, pool)[0])
        self.graphs[bucket] = graphs

    # -- a step ------------------------------------------------------------------------------

    def run(self, input_ids: torch.Tensor, positions: np.ndarray, steps) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of one step's ``n`` tokens (``input_ids`` on the
        device, ``positions`` on the host, ``steps`` the step's eager attention steps):
        the segments of n's bucket replayed, each layer's attention run between them."""
        n = input_ids.shape[0]
        bucket = self.bucket_for(n)
        if bucket is None:
            raise ValueError(f"a step of {n} tokens exceeds the largest piecewise bucket "
                             f"{self.buckets[-1]}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(positions), non_blocking=True)
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        graphs, buf = self.graphs[bucket], self.buffers
        graphs[0].replay()
        for layer, graph in zip(self.layers, graphs[1:], strict=True):
            attn = layer.self_attn
            out = attn.attend(buf["q"][:n], buf["k"][:n], buf["v"][:n], steps[attn.kind])
            buf["attn_out"][:n].copy_(out.reshape(n, -1))
            graph.replay()
        self.replays[bucket] += 1
        self.padding_rows += bucket - n
        return buf["hidden"][:n]
