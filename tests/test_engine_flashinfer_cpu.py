"""The engine's FlashInfer path on the CPU, through the real ``build_runner``.

``StandinLLM`` is ``chunklocal.LLM`` with two class attributes widened, nothing patched:
the FlashInfer backend may run on the CPU, where the strict stand-in of FlashInfer 0.7.2
(tests/flashinfer_standin.py: its exact signatures, plan()/run() contract and CUDA-graph
buffer aliasing, with the reference's math) takes the library's place; and CUDA graphs
are recorded by :class:`ReplayRecorder`, which keeps the captured closure and re-runs it
on replay.  A closure reads the static inputs and the persistent metadata buffers at
replay time, as a real graph reads device memory, so layout choice, the backends' own
capture steps, padding rows, scratch pages and the buffers refreshed before each replay
all run as on the GPU; only the kernels and the capture itself are the stand-in's.

Tokens are compared with the torch reference backend on the same engine flags.
"""

from __future__ import annotations

import random
import sys

import flashinfer_standin
import numpy as np
import pytest
import torch
from llama4_tiny import hf_greedy, write_tiny_llama4

import chunklocal
from chunklocal.backends.factory import BACKEND_DEVICES


class ReplayedForward:
    def __init__(self, forward, output):
        self.forward, self.output = forward, output

    def replay(self):
        self.output.copy_(self.forward())


class ReplayRecorder:
    """engine/cuda_graphs.py's GraphRecorder on the CPU: capture keeps the closure."""

    def __init__(self):
        self.recorded = 0

    def new_pool(self):
        return None

    def record(self, forward, pool):
        self.recorded += 1
        output = forward()
        return ReplayedForward(forward, output), output


class StandinLLM(chunklocal.LLM):
    backend_devices = {**BACKEND_DEVICES, "flashinfer": ("cpu", "cuda")}
    graph_recorder = ReplayRecorder()


@pytest.fixture(autouse=True)
def standin(monkeypatch):
    flashinfer_standin.install(monkeypatch)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4_fi_cpu")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield path, write_tiny_llama4(path, seed=4, attention_chunk_size=16)
    torch.set_num_threads(before)


def motif_prompts(seed, lengths=(9, 17, 30, 45, 5)):
    """Repeated motifs, so prompt-lookup drafts get accepted."""
    rng = random.Random(seed)
    prompts = []
    for n in lengths:
        motif = [rng.randrange(512) for _ in range(5)]
        prompts.append((motif * 10)[:n])
    return prompts


ENGINE = dict(max_num_seqs=5, max_num_batched_tokens=48, max_model_len=96,
              dtype=torch.float32)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "merged"])
def test_flashinfer_path_equals_the_torch_backend(ckpt, hybrid, k, graphs):
    path, hf = ckpt
    prompts = motif_prompts(k)
    kw = dict(ENGINE, num_speculative_tokens=k, hybrid_kv_cache=hybrid)
    llm = StandinLLM(path, attention_backend="flashinfer", cuda_graphs=graphs, **kw)
    assert type(llm.runner.backends[0]).__name__ == "FlashInferBackend"
    ref = chunklocal.LLM(path, attention_backend="torch", **kw)
    outputs = llm.generate(prompts, max_new_tokens=20)
    assert outputs == ref.generate(prompts, max_new_tokens=20)
    assert outputs == [hf_greedy(hf, p, 20) for p in prompts]
    if not graphs:
        assert llm.runner.graphs is None and llm.runner.graph_steps == 0
        return
    replays = llm.runner.graphs.replays
    used = {layout for layout, count in replays.items() if count}
    assert any(q == k + 1 for _, q in used), used  # decode (k = 0) or verify windows
    assert any(b > 1 for b, _ in used), used
    assert llm.runner.graphs.padding_rows > 0  # 3 live requests replay B = 4: padded
    if k:
        assert llm.last_stats.accepted_tokens > 0


@pytest.mark.parametrize("block_size, k", [(2, 3), (4, 4)])
def test_graphs_with_a_verify_window_longer_than_a_page(ckpt, block_size, k):
    """k + 1 > block_size: each backend captures over its own all-padding step (the
    1 x 1 dummy table of before refused these captures at construction)."""
    path, _ = ckpt
    kw = dict(ENGINE, num_speculative_tokens=k, block_size=block_size)
    llm = StandinLLM(path, attention_backend="flashinfer", **kw)
    assert (5, k + 1) in llm.runner.graphs.graphs  # B = max_num_seqs = 5
    prompts = motif_prompts(7)
    ref = chunklocal.LLM(path, attention_backend="torch", **kw)
    assert llm.generate(prompts, max_new_tokens=12) == ref.generate(prompts, max_new_tokens=12)
    assert any(q == k + 1 and n for (_, q), n in llm.runner.graphs.replays.items())


def test_two_ranks_over_gloo_with_graphs(ckpt):
    """Tensor parallelism: every (forked) rank builds FlashInfer backends and captures its
    graphs through build_runner; tokens equal the one-rank torch backend's."""
    path, _ = ckpt
    prompts = motif_prompts(3)
    ref = chunklocal.LLM(path, attention_backend="torch", **ENGINE)
    with StandinLLM(path, attention_backend="flashinfer", tensor_parallel_size=2,
                    **ENGINE) as llm:
        assert llm.generate(prompts, max_new_tokens=12) == \
            ref.generate(prompts, max_new_tokens=12)
        assert llm.runner.graph_steps > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_prefix_cache_hits_through_the_flashinfer_path_with_graphs(ckpt, tp):
    """Issue 21 with CUDA graphs and tensor parallelism: prompts sharing prefixes across
    chunk (16) and page boundaries, sent after the first of them; the cached engine serves
    prefix hits (rank 0 decides them; every rank reads the same pages) and its tokens
    equal the uncached torch backend's."""
    from chunklocal.engine.sampling import SamplingParams

    path, _ = ckpt
    rng = random.Random(11)
    base = [rng.randrange(512) for _ in range(70)]
    prompts = [base[:n] + [rng.randrange(512)] for n in (33, 47, 64, 69)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kw = dict(ENGINE, block_size=4)  # a chunk is 4 pages: hits hold part of its window
    ref = chunklocal.LLM(path, attention_backend="torch", enable_prefix_caching=False, **kw)
    want = [o.outputs[0].token_ids for o in ref.generate([base] + prompts, greedy,
                                                         use_tqdm=False)]
    with StandinLLM(path, attention_backend="flashinfer", tensor_parallel_size=tp,
                    **kw) as llm:
        got = llm.generate([base], greedy, use_tqdm=False)  # fills the cache first
        got += llm.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
        assert all(o.num_cached_tokens >= 32 for o in got[1:]), [o.num_cached_tokens
                                                                 for o in got]
        assert llm.runner.graph_steps > 0


@pytest.mark.parametrize("gathered", [False, True], ids=["paged-earlier", "gathered"])
@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "merged"])
def test_own_keys_ragged_path_equals_the_torch_backend(ckpt, hybrid, gathered, monkeypatch):
    """``RAGGED_OWN_KEYS``: prefill and mixed steps read their own keys from the step's K/V
    and earlier keys from the cache (prompts prefilled over several 24-token steps, across
    chunk (16) and page boundaries; prefix-cache hits that stop inside a chunk): the tokens
    equal the torch backend's, and steps with earlier keys merged them.  ``gathered``
    (``RAGGED_EARLIER``): segments of 2+ queries read their earlier keys copied from the
    pages in blocks of at most 24 keys (one ``max_num_batched_tokens``), so a 70-token
    prompt's last global step runs several blocks and merges a row more than once."""
    from chunklocal.backends.flashinfer import backend as fi_backend
    from chunklocal.bounds import sizing
    from chunklocal.engine.sampling import SamplingParams

    monkeypatch.setattr(fi_backend, "RAGGED_OWN_KEYS", True)
    monkeypatch.setattr(fi_backend, "RAGGED_EARLIER", gathered)
    monkeypatch.setattr(fi_backend, "GATHER_MIN_ROWS", 2)
    monkeypatch.setattr(sizing, "GATHER_KEYS_PER_TOKEN", 1)
    from chunklocal.backends.flashinfer import own_keys

    blocks: list[int] = []
    real_plan_block = own_keys.plan_block

    def counting_block(backend, state, parity, index, *args):
        blocks.append(index)
        return real_plan_block(backend, state, parity, index, *args)

    monkeypatch.setattr(own_keys, "plan_block", counting_block)
    merges = []
    real_merge = flashinfer_standin.standin_core.merge_state

    def counting(*args):
        merges.append(args[0].shape[0])
        return real_merge(*args)

    monkeypatch.setattr(sys.modules["flashinfer"], "merge_state", counting)
    path, _ = ckpt
    rng = random.Random(12)
    base = [rng.randrange(512) for _ in range(70)]
    prompts = [base] + [base[:n] + [rng.randrange(512)] for n in (21, 47, 66)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    kw = dict(ENGINE, max_num_batched_tokens=24, block_size=4, hybrid_kv_cache=hybrid)
    ref = chunklocal.LLM(path, attention_backend="torch", enable_prefix_caching=False, **kw)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, greedy, use_tqdm=False)]
    with StandinLLM(path, attention_backend="flashinfer", cuda_graphs=False, **kw) as llm:
        got = llm.generate(prompts[:1], greedy, use_tqdm=False)
        got += llm.generate(prompts[1:], greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
        assert any(o.num_cached_tokens for o in got[1:])
    assert merges and max(merges) > 1  # steps with earlier keys merged them
    assert (max(blocks, default=-1) >= 1) == gathered  # a step of two blocks or more


def test_flashinfer_on_the_cpu_is_refused_without_the_widened_devices(ckpt):
    path, _ = ckpt
    with pytest.raises(ValueError, match="attention_backend='flashinfer' needs a CUDA device"):
        chunklocal.LLM(path, attention_backend="flashinfer", **ENGINE)


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "merged"])
def test_piecewise_graphs_equal_the_torch_backend(ckpt, hybrid, monkeypatch):
    """Prefill and mixed steps in piecewise graphs (engine/piecewise_graphs.py, switched
    on): the segments recorded by the stand-in recorder at every bucket, replayed with each
    layer's attention run eagerly between them on the step's real rows; tokens and prompt
    logits equal the torch backend's eager steps, padded buckets included, while decode
    steps keep the whole-forward graphs."""
    from chunklocal.bounds.sizing import piecewise_buckets
    from chunklocal.engine import piecewise_graphs

    monkeypatch.setattr(piecewise_graphs, "PIECEWISE_ENABLED", True)
    path, _ = ckpt
    kw = dict(ENGINE, hybrid_kv_cache=hybrid)
    llm = StandinLLM(path, attention_backend="flashinfer", **kw)
    pw = llm.runner.piecewise
    assert pw is not None and pw.buckets == piecewise_buckets(ENGINE["max_num_batched_tokens"])
    assert all(len(g) == len(llm.model.layers) + 1 for g in pw.graphs.values())
    ref = chunklocal.LLM(path, attention_backend="torch", **kw)
    prompts = motif_prompts(2)
    assert llm.generate(prompts, max_new_tokens=20) == ref.generate(prompts, max_new_tokens=20)
    assert llm.runner.piecewise_steps > 0 and pw.padding_rows > 0
    assert len(pw.replays) > 1  # steps of several sizes
    assert llm.runner.graph_steps > 0  # decodes: the whole-forward graphs
    for got, want in zip(llm.prompt_logits(prompts), ref.prompt_logits(prompts), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_piecewise_buckets_stop_at_the_cap_and_longer_steps_run_eagerly(ckpt, monkeypatch):
    """piecewise_graphs.MAX_TOKENS below the step budget: buckets up to the cap only, steps
    past it through the eager forward, the tokens still the torch backend's."""
    from chunklocal.bounds.sizing import piecewise_buckets
    from chunklocal.engine import piecewise_graphs

    assert piecewise_graphs.MAX_TOKENS == 2048  # the default (0: no cap)
    assert piecewise_graphs.largest_bucket(8192) == 2048
    assert piecewise_graphs.largest_bucket(512) == 512
    monkeypatch.setattr(piecewise_graphs, "PIECEWISE_ENABLED", True)
    monkeypatch.setattr(piecewise_graphs, "MAX_TOKENS", 32)
    path, _ = ckpt
    llm = StandinLLM(path, attention_backend="flashinfer", **ENGINE)
    pw = llm.runner.piecewise
    assert ENGINE["max_num_batched_tokens"] > 32 and pw.buckets == piecewise_buckets(32)
    eager, forward = [], llm.model.forward
    llm.model.forward = lambda ids, *a, **k: eager.append(ids.shape[0]) or forward(ids, *a, **k)
    prompts = motif_prompts(2)
    ref = chunklocal.LLM(path, attention_backend="torch", **ENGINE)
    assert llm.generate(prompts, max_new_tokens=20) == ref.generate(prompts, max_new_tokens=20)
    assert any(n > 32 for n in eager) and llm.runner.piecewise_steps > 0


def test_piecewise_bucket_choice_and_a_step_past_the_largest(ckpt, monkeypatch):
    """PiecewiseGraphs.bucket_for: the smallest bucket holding the step, None for an empty
    step or one past the largest; run() refuses such a step naming both sizes."""
    from chunklocal.engine import piecewise_graphs

    monkeypatch.setattr(piecewise_graphs, "PIECEWISE_ENABLED", True)
    path, _ = ckpt
    pw = StandinLLM(path, attention_backend="flashinfer", **ENGINE).runner.piecewise
    assert pw.buckets == (16, 32, 48)
    assert [pw.bucket_for(n) for n in (0, 1, 16, 17, 48, 49)] == [None, 16, 16, 32, 48, None]
    with pytest.raises(ValueError, match="a step of 49 tokens exceeds the largest piecewise "
                                         "bucket 48"):
        pw.run(torch.zeros(49, dtype=torch.long), np.zeros(49, dtype=np.int64), {})


@pytest.mark.parametrize("path", ["paged", "own-keys", "gathered"])
@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decode"])
def test_an_eager_step_still_runs_its_own_plan_after_the_next_is_planned(decode_only, path,
                                                                         monkeypatch):
    """With async scheduling the engine plans step n+1 while step n is still queued
    (engine/overlap.py), so an eager build must not re-plan the wrapper step n runs: the
    backend alternates two wrappers per kind (and, on the ragged path, two host stagings).
    Here step n's attention, run again after step n+1 was built, is what it was; the third
    build reuses the first one's wrappers."""
    from chunklocal.backends.base import EngineLimits, Kind
    from chunklocal.backends.flashinfer import FlashInferBackend
    from chunklocal.backends.flashinfer import backend as fi_backend
    from chunklocal.kv_spec import FullAttentionSpec

    own_keys = path != "paged"
    monkeypatch.setattr(fi_backend, "RAGGED_OWN_KEYS", own_keys)
    # gathered: the earlier keys of segments of 2+ rows copied in blocks of 5 keys
    monkeypatch.setattr(fi_backend, "RAGGED_EARLIER", path == "gathered")
    monkeypatch.setattr(fi_backend, "GATHER_MIN_ROWS", 2)

    spec = FullAttentionSpec(4, 2, 16, torch.float32, attention_chunk_size=8)
    backend = FlashInferBackend(spec, EngineLimits(4, 64, 64, 4), 4, 2, 16, torch.float32,
                                "cpu")
    backend.gather.keys = 5
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(40, 4, 2, 16, generator=gen) for _ in range(2))
    table = np.arange(40, dtype=np.int32).reshape(4, 10)

    def step(query_lens, seq_lens):
        qsl = np.concatenate([[0], np.cumsum(query_lens)])
        md = backend.build(qsl, np.array(seq_lens), table[:len(seq_lens)])
        q = torch.randn(int(qsl[-1]), 4, 16, generator=gen)
        return md, q

    lens = [1, 1, 1] if decode_only else [1, 5, 3]
    first, q1 = step(lens, [9, 20, 14])
    # the step's own keys (the ragged path reads them): any values, the same each run
    own = {"k": torch.randn(q1.shape[0], 2, 16, generator=gen),
           "v": torch.randn(q1.shape[0], 2, 16, generator=gen)}
    want = {kind: backend.forward(first, q1, k_cache, v_cache, 0.25, kind=kind, **own)
            for kind in (Kind.CHUNKED, Kind.GLOBAL)}
    ragged = own_keys and not decode_only
    assert all(isinstance(first.wrappers[k], fi_backend.OwnKeys) == ragged for k in want)
    if ragged:
        blocks = [len(first.wrappers[k].blocks) for k in want]
        assert (max(blocks) > 1) == (path == "gathered"), blocks

    def wrapper(md, kind):
        return md.wrappers[kind].ragged if ragged else md.wrappers[kind]

    second, _ = step(lens[:2], [30, 7])
    assert all(wrapper(first, k) is not wrapper(second, k) for k in want)
    for kind, out in want.items():
        assert torch.equal(backend.forward(first, q1, k_cache, v_cache, 0.25, kind=kind,
                                           **own), out)
    third, _ = step(lens, [10, 21, 15])
    assert all(wrapper(third, k) is wrapper(first, k) for k in want)


@pytest.mark.parametrize("every_row", [False, True], ids=["some-rows", "every-row"])
@pytest.mark.parametrize("gathered", [False, True, "one-block"],
                         ids=["paged-earlier", "gathered", "one-block"])
def test_own_keys_backend_equals_the_float64_reference(gathered, every_row, monkeypatch):
    """The ragged path of one eager mixed step, both kinds of a merged group, against
    ``reference_attention`` in float64: own keys causal, earlier keys paged or (gathered)
    copied in blocks of 5 keys for segments of 2+ rows, so one segment's earlier keys span
    several blocks, each merged over the last (its log-sum-exp carried).  ``every_row``:
    every row reads earlier keys (each request's rows inside one chunk, after its start),
    and gathered, one block of every segment: the parts run on q itself (ALL_ROWS).
    ``one-block``: GATHER_MAX_BLOCKS 1, so long segments keep paged prefixes and their rows
    merge a paged part and a gathered one."""
    from chunklocal.backends.base import EngineLimits, Kind
    from chunklocal.backends.flashinfer import FlashInferBackend, own_keys
    from chunklocal.backends.flashinfer import backend as fi_backend
    from chunklocal.kv_spec import FullAttentionSpec
    from chunklocal.reference import reference_attention

    monkeypatch.setattr(fi_backend, "RAGGED_OWN_KEYS", True)
    monkeypatch.setattr(fi_backend, "RAGGED_EARLIER", bool(gathered))
    monkeypatch.setattr(fi_backend, "GATHER_MIN_ROWS", 2)
    monkeypatch.setattr(fi_backend, "GATHER_MAX_BLOCKS", 1 if gathered == "one-block" else 4)
    spec = FullAttentionSpec(4, 2, 16, torch.float32, attention_chunk_size=8)
    backend = FlashInferBackend(spec, EngineLimits(4, 64, 64, 4), 4, 2, 16, torch.float32,
                                "cpu")
    backend.gather.keys = 500 if every_row else 5
    if every_row:
        monkeypatch.setattr(fi_backend, "GATHER_MIN_ROWS", 1)
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(40, 4, 2, 16, generator=gen) for _ in range(2))
    table = np.random.default_rng(3).permutation(40).astype(np.int32).reshape(4, 10)
    q_lens, seq = np.array([1, 5, 3, 9]), np.array([9, 20, 14, 30])
    if every_row:  # rows at 9; 17-19; 25-29; 33-38: each after its chunk's start
        q_lens, seq = np.array([1, 3, 5, 6]), np.array([10, 20, 30, 39])
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    md = backend.build(qsl, seq, table)
    q = torch.randn(int(qsl[-1]), 4, 16, generator=gen)
    # the step's own K/V: what the layer wrote at its positions
    req = np.repeat(np.arange(4), q_lens)
    pos = (seq - q_lens)[req] + np.arange(int(qsl[-1])) - qsl[:-1][req]
    slot = torch.from_numpy(table[req, pos // 4].astype(np.int64) * 4 + pos % 4)
    own = {"k": k_cache.view(-1, 2, 16)[slot], "v": v_cache.view(-1, 2, 16)[slot]}
    for kind, chunk in ((Kind.CHUNKED, 8), (Kind.GLOBAL, None)):
        step = md.wrappers[kind]
        if gathered == "one-block" and not every_row:
            assert len(step.blocks) == 1 and step.earlier is not None, kind
            rows = set(step.blocks[0][1].tolist())
            paged = set(range(q.shape[0])) if isinstance(step.rows, str) \
                else set(step.rows.tolist())
            assert rows & paged, kind  # rows reading a paged prefix and a block
        elif every_row:
            rows = [b[1] for b in step.blocks] if gathered else [step.rows]
            assert rows and all(r is own_keys.ALL_ROWS for r in rows), (kind, rows)
        else:
            assert (len(step.blocks) > 1) == gathered, (kind, len(step.blocks))
        got = backend.forward(md, q, k_cache, v_cache, 0.25, kind=kind, **own)
        want = reference_attention(q.double(), k_cache.double(), v_cache.double(), qsl, seq,
                                   table, chunk_size=chunk, scale=0.25)
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_decode_graphs_replan_each_step_for_its_own_lengths(monkeypatch):
    """``GRAPH_REPLAN``: a decode graph's wrappers are planned again before each replay for
    the step's lengths (the stand-in refuses keys beyond a graph's split-KV plan, as the
    kernel's tiles would drop them), each kind alternating two host staging buffers; the
    capture keeps the plan for the longest keys.  Graph outputs equal the eager steps'."""
    from chunklocal.backends.base import EngineLimits, Kind
    from chunklocal.backends.flashinfer import FlashInferBackend
    from chunklocal.backends.flashinfer import backend as fi_backend
    from chunklocal.kv_spec import FullAttentionSpec

    spec = FullAttentionSpec(4, 2, 16, torch.float32, attention_chunk_size=8)
    backend = FlashInferBackend(spec, EngineLimits(4, 64, 64, 4), 4, 2, 16, torch.float32,
                                "cpu", cuda_graphs=True, graph_batch_sizes=(4,),
                                scratch_page=39)
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = (torch.randn(40, 4, 2, 16, generator=gen) for _ in range(2))
    table = np.arange(36, dtype=np.int32).reshape(3, 12)
    kinds = (Kind.CHUNKED, Kind.GLOBAL)
    graph = backend.capture_step(4, 1)
    capture_plans = {k: graph.wrappers[k]._planned_kv_lens for k in kinds}
    assert capture_plans[Kind.GLOBAL] == [64] * 4  # the longest keys, max_model_len

    def step(seq_lens):
        n = len(seq_lens)
        md = backend.build(np.arange(n + 1), np.array(seq_lens), table[:n],
                           graph_batch_size=4)
        q = torch.randn(4, 4, 16, generator=gen)
        eager = backend.build(np.arange(n + 1), np.array(seq_lens), table[:n])
        for kind in kinds:
            got = backend.forward(md, q, k_cache, v_cache, 0.25, kind=kind)[:n]
            want = backend.forward(eager, q[:n], k_cache, v_cache, 0.25, kind=kind)
            torch.testing.assert_close(got, want)
        return md

    monkeypatch.setattr(fi_backend, "GRAPH_REPLAN", True)
    staged = []
    for lens in ([9, 20, 14], [3, 5, 2], [40, 7, 30]):
        md = step(lens)
        wrapper = md.wrappers[Kind.GLOBAL]
        assert wrapper._planned_kv_lens == lens + [1]  # the step's own, padding one key
        staged.append(wrapper._pin_memory_int_workspace_buffer)
    state = backend._kinds[Kind.GLOBAL]
    assert staged[0] is staged[2] is state.replan_staging[0]
    assert staged[1] is state.replan_staging[1]
    # planned for short contexts, the buffers refreshed for longer ones without a plan:
    # the stand-in refuses (the kernel's tiles would drop keys)
    md = step([3, 5, 2])
    graph_step, _ = state.buffers.write_graph_step(
        np.array([40, 7, 30, 0]), table[[0, 1, 2, 0]], 1, None, False, 39)
    state.buffers.copy_to_device(graph_step)
    with pytest.raises(RuntimeError, match="the split-KV plan covers"):
        backend.forward(md, torch.zeros(4, 4, 16), k_cache, v_cache, 0.25, kind=Kind.GLOBAL)
    # the switch off again: the next build plans for the longest keys first
    monkeypatch.setattr(fi_backend, "GRAPH_REPLAN", False)
    md = step([40, 7, 30])
    assert md.wrappers[Kind.GLOBAL]._planned_kv_lens == [64] * 4 and not md.replanned
    step([41, 8, 31])


@pytest.mark.parametrize("k", [0, 3])
def test_engine_with_decode_graphs_replanned_equals_the_torch_backend(ckpt, k, monkeypatch):
    """``GRAPH_REPLAN`` through the engine's loop (async scheduling, graphs of several
    sizes, verify windows with k = 3, which keep their plan): the torch backend's tokens, and
    the decode graphs' wrappers were planned again (their staging buffers exist)."""
    from chunklocal.backends.flashinfer import backend as fi_backend

    monkeypatch.setattr(fi_backend, "GRAPH_REPLAN", True)
    path, _ = ckpt
    prompts = motif_prompts(k)
    kw = dict(ENGINE, num_speculative_tokens=k)
    llm = StandinLLM(path, attention_backend="flashinfer", cuda_graphs=True, **kw)
    ref = chunklocal.LLM(path, attention_backend="torch", **kw)
    assert llm.generate(prompts, max_new_tokens=20) == ref.generate(prompts,
                                                                    max_new_tokens=20)
    assert llm.runner.graph_steps > 0
    states = [s for b in llm.runner.backends for s in b._kinds.values()]
    assert all(s.replan_staging is not None for s in states) == (k == 0)


def test_eager_flashinfer_steps_overlap_unless_switched_off(ckpt, monkeypatch):
    """By default (CHUNKLOCAL_OVERLAP_EAGER unset) an eager step on backends that
    double-buffer their plans is overlap-safe: on a GPU the engine launches the next step
    before collecting it (overlap.overlappable), as it does after a graph replay.  With the
    switch off (``CHUNKLOCAL_OVERLAP_EAGER=0``), or on a backend that does not say so, it
    keeps the old order."""
    from types import SimpleNamespace

    from chunklocal.backends.flashinfer import backend as fi_backend
    from chunklocal.engine.overlap import overlappable

    path, _ = ckpt
    assert fi_backend.OVERLAP_EAGER  # the default: the sixteenth session's serve A/B
    monkeypatch.setattr(fi_backend, "OVERLAP_EAGER", False)
    off = StandinLLM(path, attention_backend="flashinfer", cuda_graphs=False, **ENGINE)
    assert not off.runner.overlaps_eager
    monkeypatch.setattr(fi_backend, "OVERLAP_EAGER", True)
    llm = StandinLLM(path, attention_backend="flashinfer", cuda_graphs=False, **ENGINE)
    flags, real = [], llm.runner.launch

    def recording(batch, prev=None):
        launched = real(batch, prev)
        flags.append(launched.overlap_safe)
        return launched

    llm.runner.launch = recording
    prompts = motif_prompts(2)
    assert llm.generate(prompts, max_new_tokens=8) == chunklocal.LLM(
        path, attention_backend="torch", **ENGINE).generate(prompts, max_new_tokens=8)
    assert flags and all(flags) and llm.runner.overlaps_eager
    llm.runner.backends[0].overlaps_eager_steps = False
    assert not llm.runner.overlaps_eager
    llm.runner.backends[0] = SimpleNamespace()  # a backend that does not declare it
    assert not llm.runner.overlaps_eager
    gpu = SimpleNamespace(llm=SimpleNamespace(async_scheduling=True, num_speculative_tokens=0,
                                              device=torch.device("cuda")), num_penalised=0)
    assert overlappable(gpu, SimpleNamespace(overlap_safe=True))
    assert not overlappable(gpu, SimpleNamespace(overlap_safe=False))
