"""gpu_memory_utilization (engine/memory.py), on the CPU: the whole GPU procedure runs against
a fake device memory (``LLM.device_memory``), whose numbers the test chooses, so the sizing
logic is covered up to the torch.cuda calls themselves (tests/gpu/test_memory_gpu.py runs
those on a GPU)."""

from __future__ import annotations

import logging

import flashinfer_standin
import pytest
from llama4_tiny import write_tiny_llama4

import chunklocal
from chunklocal.backends.factory import BACKEND_DEVICES
from chunklocal.bounds.kv_pools import plan_kv_pools
from chunklocal.engine import llm as llm_module
from chunklocal.engine import runner_setup
from chunklocal.engine.memory import PROFILE_HEADROOM, MemoryBudget, check_utilization
from chunklocal.engine.model_runner import ModelRunner

MIB = 2**20
WEIGHTS, ACTIVATIONS, CONTEXT = 3 * MIB, 5 * MIB, 2 * MIB
HEADROOM = int(PROFILE_HEADROOM * 64 * MIB)  # of the fakes' 64 MiB device


class FakeMemory:
    """A device of ``total`` bytes, ``other`` of them held by someone else.  ``held``: what
    torch has allocated (the weights once they load); the peak since a reset is ``held``
    ACTIVATIONS when a step ran in between (and the new runner's KV pages, which a real
    allocator counts when the runner was made after the reset); CONTEXT appears outside torch
    once the weights load (a CUDA context, library workspaces)."""

    def __init__(self, total, other=0):
        self.total_bytes, self.other, self.held, self.outside = total, other, 0, 0
        self.stranded = 0  # torch's cache, unallocated and not returnable by empty_cache
        self.events: list[str] = []
        self.stepped, self.pages, self.runners = False, 0, set()

    def total(self):
        return self.total_bytes

    def free(self):
        return self.total_bytes - self.other - self.held - self.stranded - self.outside

    def allocated(self):
        return self.held

    def reserved(self):  # torch's cache: what is allocated, and ``stranded`` beside it
        return self.held + self.stranded

    def peak(self):
        self.events.append("peak")
        return self.held + (ACTIVATIONS + self.pages if self.stepped else 0)

    def reset_peak(self):
        self.events.append("reset")
        self.stepped, self.pages = False, 0

    def empty_cache(self):
        pass


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4_memory")
    write_tiny_llama4(path, seed=0)
    return path


@pytest.fixture
def fake(monkeypatch):
    """LLM's device memory is a FakeMemory of 64 MiB; loading the weights takes WEIGHTS of
    it (and CONTEXT outside torch); each runner step is recorded with its token count."""
    memory = FakeMemory(64 * MIB)
    monkeypatch.setattr(chunklocal.LLM, "device_memory", lambda device: memory)
    real_load, real_run = llm_module.load_model, ModelRunner.run

    def load(*args, **kwargs):
        memory.events.append("load")
        memory.held, memory.outside = memory.held + WEIGHTS, CONTEXT
        return real_load(*args, **kwargs)

    def run(runner, batch):
        memory.events.append(f"step {len(batch.seqs)}x{sum(batch.num_new)}")
        memory.stepped = True
        if runner.model is not None and id(runner) not in memory.runners:
            # made since the reset: its pages count (a tensor-parallel caller has no model)
            memory.runners.add(id(runner))
            memory.pages = runner_setup._kv_bytes(runner.model)
        return real_run(runner, batch)

    real_capture = ModelRunner.enable_cuda_graphs

    def capture(runner, *args):
        memory.events.append("capture")
        memory.stepped = True
        return real_capture(runner, *args)

    monkeypatch.setattr(llm_module, "load_model", load)
    monkeypatch.setattr(ModelRunner, "run", run)
    monkeypatch.setattr(ModelRunner, "enable_cuda_graphs", capture)
    return memory


KW = dict(max_num_seqs=256, max_num_batched_tokens=96, max_model_len=1024)


def expected_pools(llm, budget: MemoryBudget):
    layers = {kind: llm.layer_kinds.count(kind) for kind in set(llm.layer_kinds)}
    specs = {kind: llm._spec(kind, llm.groups[0].spec.dtype) for kind in layers}
    return plan_kv_pools(layers, specs, hybrid=True, available=budget.requested,
                         weight_bytes=budget.weights, reserved_bytes=budget.reserved,
                         fraction=1.0, block_size=16, **KW)


def test_pools_take_the_fraction_of_total_memory_less_weights_and_the_profiled_step(
        path, fake, caplog):
    """KV = u x total - weights - peak activations - non-torch growth: the fraction of the
    device's TOTAL memory (not of what is free: someone else holds 10 MiB of it), the
    weights as measured after loading, one step of the largest shape measured between a
    peak reset and the peak."""
    fake.other = 10 * MIB
    with caplog.at_level(logging.INFO, logger="chunklocal.engine.llm"):
        llm = chunklocal.LLM(path, gpu_memory_utilization=0.75, **KW)
    budget = llm.memory_budget
    assert (budget.total, budget.weights, budget.activations, budget.graphs,
            budget.outside_torch) == (64 * MIB, WEIGHTS, ACTIVATIONS, 0, CONTEXT)
    assert budget.requested == 48 * MIB
    # vLLM's profile shape: max_num_batched_tokens over min(max_num_seqs, tokens) prompts.
    assert fake.events[:4] == ["load", "reset", "step 96x96", "peak"], fake.events
    want = expected_pools(llm, budget)
    assert [g.num_blocks for g in llm.groups] == [g.pages for g in want.groups]
    kv = llm.kv_pools.total_bytes
    assert kv == want.total_bytes
    # The whole budget is spent (less than a global page is left), and no more.
    left = budget.requested - WEIGHTS - ACTIVATIONS - CONTEXT - HEADROOM - kv
    assert 0 <= left < llm.kv_pools.groups[-1].page_bytes
    line = [r.getMessage() for r in caplog.records if "KV cache" in r.getMessage()]
    assert len(line) == 1 and line[0].startswith(
        f"weights 0.00 GiB, KV cache {kv / 2**30:.2f} GiB (pages per KV group: chunked "
        f"{llm.groups[0].num_blocks}, global {llm.groups[1].num_blocks}); "
        f"{llm.kv_pools.requests_fit()} requests of max_model_len 1024 fit at once")
    assert "gpu_memory_utilization=0.75 of 0.1 GiB" in line[0]
    # The profile's pages are gone; the engine serves from its own.
    assert len(llm.generate([[1, 2, 3]], max_new_tokens=4, ignore_eos=True)[0]) == 4


def test_cache_torch_cannot_return_is_reserved_and_named_apart(path, fake, monkeypatch,
                                                               caplog):
    """Bytes torch's cache holds unallocated after empty_cache (pieces of segments partly in
    use; MoE.stack_shared left 26 GiB of them on full-size Scout FP8) are neither free nor
    non-torch memory: the pools lose them, and the start-up line names them apart."""
    real_load = llm_module.load_model

    def load(*args, **kwargs):
        fake.stranded = 4 * MIB  # on top of the fixture's weights and context
        return real_load(*args, **kwargs)

    monkeypatch.setattr(llm_module, "load_model", load)
    with caplog.at_level(logging.INFO, logger="chunklocal.engine.llm"):
        llm = chunklocal.LLM(path, gpu_memory_utilization=0.75, **KW)
    budget = llm.memory_budget
    assert (budget.outside_torch, budget.cached) == (CONTEXT, 4 * MIB)
    left = budget.requested - WEIGHTS - ACTIVATIONS - CONTEXT - 4 * MIB - HEADROOM \
        - llm.kv_pools.total_bytes
    assert 0 <= left < llm.kv_pools.groups[-1].page_bytes
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("weights ")]
    assert "0.00 GiB outside torch, 0.00 GiB that torch's cache holds and cannot return" \
        in line[0]
    # 4 MiB of a 64 MiB device is past STRANDED_WARN: said once, as a warning
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "0.00 GiB of device memory sits in torch's cache" \
        in warned[0].getMessage()
    assert MemoryBudget(0.9, 100, 50, cached=1).stranded_warning() is None
    assert MemoryBudget(0.9, 100, 50, cached=2).stranded_warning() is not None


def test_a_smaller_fraction_gives_fewer_pages(path, fake):
    """Each spends its own budget (less than one page of each pool left over); the second
    engine's baseline already holds the first's weights and context, which it does not
    count as its own."""
    pools = {}
    for u in (0.75, 0.5):
        llm = chunklocal.LLM(path, gpu_memory_utilization=u, **KW)
        budget, kv = llm.memory_budget, llm.kv_pools
        left = budget.requested - budget.weights - budget.reserved - kv.total_bytes
        assert 0 <= left < sum(g.page_bytes for g in kv.groups), (u, budget, kv)
        assert budget.weights == WEIGHTS
        pools[u] = kv.total_bytes
    assert pools[0.5] < pools[0.75] - 8 * MIB


def test_the_cap_of_whole_requests_still_binds(path, fake):
    llm = chunklocal.LLM(path, gpu_memory_utilization=1.0, max_num_seqs=2,
                         max_num_batched_tokens=96, max_model_len=256)
    assert llm.groups[-1].num_blocks == 2 * 256 // 16


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.01, 2, float("nan"), "0.9", None, True])
def test_values_outside_0_1_are_refused_before_weights_load(path, fake, value):
    with pytest.raises(ValueError, match=rf"gpu_memory_utilization must be a fraction in "
                                         rf"\(0, 1\] .*got {value!r}"):
        chunklocal.LLM(path, gpu_memory_utilization=value, **KW)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        check_utilization(value)
    assert "load" not in fake.events


def test_one_is_allowed_and_the_default_is_vllms(path, fake):
    assert check_utilization(1) == 1.0
    assert chunklocal.LLM(path, max_model_len=256).memory_budget.utilization == 0.9


def test_too_little_free_memory_is_refused_before_weights_load(path, fake):
    """vLLM's start-up check: u x total must be free when the engine starts."""
    fake.other = 40 * MIB
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.75 asks 0.0 GiB of "
                                         r"cpu's 0.1 GiB, but only 0.0 GiB is free: pass "
                                         r"gpu_memory_utilization <= 0.375"):
        chunklocal.LLM(path, gpu_memory_utilization=0.75, **KW)
    assert "load" not in fake.events
    assert chunklocal.LLM(path, gpu_memory_utilization=0.375, **KW).kv_pools.total_bytes > 0


def test_weights_or_one_request_beyond_the_fraction_are_refused_before_loading(
        path, fake, monkeypatch, tmp_path):
    plan_load = llm_module.plan_load

    def heavy(*args, **kwargs):
        plan = plan_load(*args, **kwargs)
        monkeypatch.setattr(plan, "weight_bytes", lambda dtype: 40 * MIB)
        return plan

    with monkeypatch.context() as m:
        m.setattr(llm_module, "plan_load", heavy)
        with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.5 gives 0.0 GiB .* "
                                             r"less than the 0.0 GiB of weights"):
            chunklocal.LLM(path, gpu_memory_utilization=0.5, **KW)
    with pytest.raises(ValueError, match=r"one request of max_model_len 262144 needs .* "
                                         r"\(gpu_memory_utilization=0.5 of"):
        write_tiny_llama4(tmp_path, max_position_embeddings=1 << 20)
        chunklocal.LLM(tmp_path, gpu_memory_utilization=0.5, max_num_seqs=1,
                       max_model_len=262144)
    assert "load" not in fake.events


def test_activations_that_leave_no_room_are_refused_after_the_profile(path, fake):
    """What the profile measures is reserved: a step as large as the budget leaves nothing."""
    global ACTIVATIONS
    saved, ACTIVATIONS = ACTIVATIONS, 40 * MIB
    try:
        with pytest.raises(ValueError, match=r"the weights need 0.0 GiB and 0.0 GiB more "
                                             r"is reserved beside them, 0.0 GiB is available "
                                             r"on cpu \[gpu_memory_utilization=0.5 of 0.1 GiB, "
                                             r"less 0.00 GiB of weights, 0.04 GiB of "
                                             r"activations"):
            chunklocal.LLM(path, gpu_memory_utilization=0.5, **KW)
    finally:
        ACTIVATIONS = saved


def test_num_kv_blocks_and_the_cpu_keep_their_own_sizing(path, monkeypatch):
    """No fake: the CPU's RAM budget (40% of MemAvailable after the weights), no profile;
    num_kv_blocks as given."""
    monkeypatch.setattr(llm_module, "available_memory", lambda device: 1 << 30)
    monkeypatch.setattr(runner_setup, "profile_run", lambda *a: pytest.fail("profiled"))
    llm = chunklocal.LLM(path, gpu_memory_utilization=0.1, **KW)
    assert llm.memory_budget is None and llm.kv_pools.total_bytes <= 0.4 * (1 << 30)
    assert chunklocal.LLM(path, num_kv_blocks=100, **KW).groups[-1].num_blocks == 100


class StandinLLM(chunklocal.LLM):
    """FlashInfer's stand-in with CUDA graphs replayed on the CPU (test_engine_flashinfer_cpu)."""

    backend_devices = {**BACKEND_DEVICES, "flashinfer": ("cpu", "cuda")}


def test_cuda_graphs_get_a_profiled_reserve(path, fake, monkeypatch):
    """With graphs, the profile runner captures them (as the engine will), and their peak
    is kept out of the KV budget; the engine then captures its own."""
    from test_engine_flashinfer_cpu import ReplayRecorder

    flashinfer_standin.install(monkeypatch)
    monkeypatch.setattr(StandinLLM, "graph_recorder", ReplayRecorder())
    llm = StandinLLM(path, attention_backend="flashinfer", gpu_memory_utilization=0.75,
                     max_num_seqs=8, max_num_batched_tokens=96, max_model_len=1024)
    assert llm.cuda_graphs
    assert fake.events[1:8] == ["reset", "step 8x96", "peak", "reset", "capture", "peak",
                                "capture"], fake.events
    assert llm.memory_budget.graphs == ACTIVATIONS
    assert llm.memory_budget.reserved == 2 * ACTIVATIONS + CONTEXT + HEADROOM
    assert len(llm.generate([[1, 2, 3]], max_new_tokens=4, ignore_eos=True)[0]) == 4


class _Garbage:
    """An engine dropped earlier that sits in a reference cycle, holding ``size`` bytes of
    ``memory`` until Python's cycle collector runs."""

    def __init__(self, memory, size):
        self.memory, self.size, self.me = memory, size, self
        memory.held += size

    def __del__(self):
        self.memory.held -= self.size


class _Counter:
    """allocated / peak of a real allocator: ``held`` now, and the most held since reset."""

    def __init__(self):
        self.held = self.top = 0

    def allocated(self):
        return self.held

    def peak(self):
        return self.top

    def reset_peak(self):
        self.top = self.held

    def empty_cache(self):
        pass


def test_garbage_collected_during_a_profiled_step_does_not_hide_its_peak():
    """peak_of collects cycles before its first reading: the H200 profiled 0 bytes of
    activations when an earlier test's engine was collected in the middle of the step."""
    import gc

    from chunklocal.engine.memory import peak_of

    memory = _Counter()
    _Garbage(memory, 100 * MIB)

    def step():
        gc.collect()  # the collector runs somewhere inside the step
        memory.held += 7 * MIB
        memory.top = max(memory.top, memory.held)
        memory.held -= 7 * MIB

    assert peak_of(memory, step) == 7 * MIB


def test_tensor_parallel_ranks_each_profile_their_own_device(path, fake, monkeypatch):
    """Two ranks (gloo; forked, so each has its own copy of the fake device): each takes its
    baseline before loading, loads its slices and runs the largest step with its peer, and the
    pools are what one rank's budget leaves (vLLM sizes each worker so), not 40% of free."""
    from chunklocal.models import loader

    real_load = loader.load_model

    def load(*args, **kwargs):  # what a rank's load takes of its device
        fake.events.append("load")
        fake.held, fake.outside = fake.held + WEIGHTS, CONTEXT
        return real_load(*args, **kwargs)

    monkeypatch.setattr(loader, "load_model", load)
    with chunklocal.LLM(path, gpu_memory_utilization=0.75, tensor_parallel_size=2,
                        **KW) as llm:
        budget = llm.memory_budget
        assert (budget.total, budget.weights, budget.activations, budget.graphs,
                budget.outside_torch) == (64 * MIB, WEIGHTS, ACTIVATIONS, 0, CONTEXT)
        want = expected_pools(llm, budget)
        assert [g.num_blocks for g in llm.groups] == [g.pages for g in want.groups]
        assert fake.events == []  # the caller's process measured nothing: the ranks did
        assert len(llm.generate([[1, 2, 3]], max_new_tokens=4, ignore_eos=True)[0]) == 4


@pytest.mark.parametrize("count, tokens, max_model_len", [
    (7, 100, 1024), (1, 64, 1024), (32, 32, 1024), (3, 48, 16)])
@pytest.mark.parametrize("chunk", [None, 8])
def test_the_profiled_step_reads_earlier_keys_in_its_rows(count, tokens, max_model_len, chunk):
    """The profile step sends nearly every row down the backends' earlier-keys path (the
    ragged own-keys split's paged part and merge), whose buffers a step of fresh prompts
    never allocates: one computed token ahead of each request that fits max_model_len,
    inside profile_run's page count (the pool is exactly that size; two pages short fails).
    Of several requests the first stays fresh, so the rows that read earlier keys are not
    all of them: the merge gathers them (the heavier form) rather than taking every row."""
    import numpy as np
    import torch

    from chunklocal.backends.flashinfer.ragged import ragged_split
    from chunklocal.engine.block_manager import KVGroup
    from chunklocal.kv_spec import ChunkedLocalAttentionSpec, FullAttentionSpec

    bs = 16
    spec = (FullAttentionSpec(bs, 1, 8, torch.float32) if chunk is None
            else ChunkedLocalAttentionSpec(bs, 1, 8, torch.float32, chunk * bs))
    pages = count + -(-tokens // bs) + 1  # profile_run's
    batch, _ = runner_setup.profile_batch(count, tokens, bs, 500, [KVGroup(spec, pages)],
                                          max_model_len)
    assert sum(batch.num_new) == tokens and len(batch.seqs) == count
    fits = [n < max_model_len and (i > 0 or count == 1) for i, n in enumerate(batch.num_new)]
    assert [s.num_computed for s in batch.seqs] == [int(f) for f in fits]
    assert all(len(s.token_ids) == s.num_computed + n <= max_model_len
               for s, n in zip(batch.seqs, batch.num_new, strict=True))
    qsl = np.concatenate([[0], np.cumsum(batch.num_new)])
    seq_lens = np.array([s.num_computed + n for s, n in zip(batch.seqs, batch.num_new,
                                                              strict=True)])
    width = max(len(s.block_tables[0]) for s in batch.seqs)
    table = np.array([s.block_tables[0] + [0] * (width - len(s.block_tables[0]))
                      for s in batch.seqs], np.int32)
    split = ragged_split(qsl, seq_lens, table, chunk and chunk * bs, bs)
    # rows of a request's first chunk see its computed token; later chunks' rows do not
    want = sum(min(n, (chunk * bs - 1) if chunk else n) for n, f in zip(
        batch.num_new, fits, strict=True) if f)
    assert split.paged_rows.size == want > 0 or not any(fits)
    assert split.paged_rows.size < tokens or count == 1  # not every row: rows gathered
