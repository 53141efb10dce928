"""The CUDA-graph step logic (engine/cuda_graphs.py) run on the CPU.

A graph is simulated: "capture" keeps the forward closure, which reads the
static input buffers, and "replay" runs it again into the static output.  The
fake backend keeps one metadata object per (B, q) and refreshes it in place on
``build(..., graph_batch_size=B)``, as FlashInfer's persistent buffers are.  So
layout choice, padding rows (token 0, scratch-page slots), static buffers and
uniform verify windows (padded drafts) are checked in CI against transformers;
only the capture itself needs the GPU (tests/gpu/test_engine_gpu.py).
"""

from __future__ import annotations

import random

import pytest
import torch
from llama4_tiny import hf_greedy, write_tiny_llama4

import chunklocal
from chunklocal.engine.cuda_graphs import CudaGraphs


class ReplayedForward:
    def __init__(self, forward, output):
        self.forward, self.output = forward, output

    def replay(self):
        self.output.copy_(self.forward())


class CpuGraphs(CudaGraphs):
    def _new_pool(self):
        return None

    def _record(self, forward, pool):
        output = forward()
        return ReplayedForward(forward, output), output


class StaticMetadata:
    inner = None
    rows = 0


class FakeGraphBackend:
    """TorchRefBackend plus FlashInfer's graph protocol (padding rows give zeros)."""

    def __init__(self, inner):
        self.inner, self.static = inner, {}

    def build(self, query_start_loc, seq_lens, block_table, *, graph_batch_size=None):
        if graph_batch_size is None:
            return self.inner.build(query_start_loc, seq_lens, block_table)
        assert len(seq_lens) <= graph_batch_size
        query_len = int(query_start_loc[1] - query_start_loc[0])
        md = self.static.setdefault((graph_batch_size, query_len), StaticMetadata())
        md.inner = self.inner.build(query_start_loc, seq_lens, block_table)
        md.rows = int(query_start_loc[-1])
        return md

    def forward(self, md, q, k_cache, v_cache, scale, *, kind=None):
        if not isinstance(md, StaticMetadata):
            return self.inner.forward(md, q, k_cache, v_cache, scale, kind=kind)
        out = torch.zeros_like(q)
        out[:md.rows] = self.inner.forward(md.inner, q[:md.rows], k_cache, v_cache, scale,
                                           kind=kind)
        return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4_graphs")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield path, write_tiny_llama4(path, seed=4, attention_chunk_size=16)
    torch.set_num_threads(before)


def with_cpu_graphs(llm, batch_sizes, query_lens):
    runner = llm.runner
    runner.backends = [FakeGraphBackend(b) for b in runner.backends]
    runner.graphs = CpuGraphs(runner.model, runner.graph_steps_for,
                              [grp.scratch_page * runner.block_size for grp in runner.groups],
                              batch_sizes, query_lens, runner.device)
    llm.scheduler.pad_drafts = len(query_lens) > 1
    return runner.graphs


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "merged"])
def test_graph_steps_match_transformers(ckpt, k, hybrid):
    path, hf = ckpt
    rng = random.Random(k)
    prompts = []
    for n in (9, 17, 30, 45, 5):  # repeated motifs so drafts get accepted
        motif = [rng.randrange(512) for _ in range(5)]
        prompts.append((motif * 10)[:n])
    llm = chunklocal.LLM(path, max_num_seqs=5, max_num_batched_tokens=48, max_model_len=96,
                         num_speculative_tokens=k, hybrid_kv_cache=hybrid)
    # B = 8 > max_num_seqs: every graph step has padding rows while all requests live.
    graphs = with_cpu_graphs(llm, (1, 2, 4, 8), (1, k + 1) if k else (1,))
    outputs = llm.generate(prompts, max_new_tokens=20)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out == hf_greedy(hf, prompt, 20)
    used = {layout for layout, count in graphs.replays.items() if count}
    assert any(q == k + 1 for _, q in used), used  # decode (k = 0) or verify windows
    if k:
        assert llm.last_stats.accepted_tokens > 0
    assert any(b > 1 for b, _ in used), used
    assert graphs.padding_rows > 0  # some replays ran padded batches


def test_layout_choice():
    graphs = CpuGraphs.__new__(CpuGraphs)
    graphs.batch_sizes, graphs.query_lens = (1, 2, 4, 8), (1, 4)
    import numpy as np

    layout = graphs.layout_for
    assert layout(np.array([1, 1, 1]), np.zeros(3, int)) == (4, 1)
    assert layout(np.array([4, 4]), np.full(2, 3)) == (2, 4)
    assert layout(np.array([4, 1]), np.array([3, 0])) is None        # ragged
    assert layout(np.array([3, 3]), np.full(2, 2)) is None           # no (B, 3) graph
    assert layout(np.array([5]), np.zeros(1, int)) is None           # a prefill piece
    assert layout(np.ones(9, int), np.zeros(9, int)) is None         # more than B_max
