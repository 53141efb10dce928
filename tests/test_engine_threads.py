"""Several threads calling ``LLM.generate`` / ``prompt_logits`` on one LLM (issue 13).

Oracle: each call's own sequential greedy run on the same engine (greedy float32 on the
CPU is batch-invariant here: the engine already matches transformers one prompt at a
time, see test_engine.py).  Before the engine core, two threads cut one thread's
outputs to 3 of 20 tokens and gave the other an unrelated numpy error.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
import torch
from llama4_tiny import write_tiny_llama4

import chunklocal

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4_threads")
    write_tiny_llama4(path, seed=0)
    return chunklocal.LLM(path, max_num_seqs=4, max_num_batched_tokens=48, max_model_len=160)


def prompts_for(call: int, count: int = 3):
    rng = random.Random(call)
    return [[rng.randrange(512) for _ in range(rng.randrange(3, 60))] for _ in range(count)]


def run_threads(target, num_threads, timeout=120):
    """``[target(0), ..., target(num_threads - 1)]``, each called on its own thread, all
    started before any is joined; fails if a call hangs past ``timeout`` s or raises."""
    results, errors = [None] * num_threads, []

    def work(i):
        try:
            results[i] = target(i)
        except BaseException as err:  # noqa: B036 - reported below, with its thread
            errors.append((i, err))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a generate() call hung"
    assert not errors, errors
    return results


@pytest.mark.parametrize("repeat", range(3))
def test_threads_each_get_their_sequential_greedy_outputs(llm, repeat):
    num_threads, new = 4, 20
    prompts = [prompts_for(10 * repeat + i) for i in range(num_threads)]
    want = [llm.generate(p, max_new_tokens=new, ignore_eos=True) for p in prompts]
    assert all(len(out) == new for outs in want for out in outs)
    got = run_threads(lambda i: llm.generate(prompts[i], max_new_tokens=new, ignore_eos=True),
                      num_threads)
    assert got == want
    assert not llm.scheduler.has_work()
    assert all(g.num_free == g.num_blocks for g in llm.groups)


def test_threads_mixing_generate_prompt_logits_and_sampling(llm):
    """Threads calling different entry points at once: each result equals its sequential
    run (logits to 1e-5), and each thread's last_stats is of its own call."""
    from chunklocal.engine.sampling import SamplingParams

    prompts = [prompts_for(100 + i, count=2 + i % 2) for i in range(6)]
    seeded = [SamplingParams(temperature=1.0, seed=i, max_tokens=15) for i in range(3)]

    def call(i):
        if i % 3 == 0:
            return llm.generate(prompts[i], max_new_tokens=12 + i, ignore_eos=True)
        if i % 3 == 1:
            return llm.prompt_logits(prompts[i], last_only=i == 4)
        outs = llm.generate(prompts[i], seeded[:len(prompts[i])])
        return [o.outputs[0].token_ids for o in outs]

    want = [call(i) for i in range(6)]
    stats = {}

    def threaded(i):
        result = call(i)
        stats[i] = llm.last_stats
        return result

    got = run_threads(threaded, 6)
    for i in range(6):
        if i % 3 == 1:
            for a, b in zip(got[i], want[i], strict=True):
                assert a.shape == b.shape
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:
            assert got[i] == want[i], i
        assert stats[i].requests == len(prompts[i])
        assert stats[i].prompt_tokens == sum(map(len, prompts[i]))
        new = {0: 12 + i, 1: 1, 2: 15}[i % 3]
        assert stats[i].new_tokens == new * len(prompts[i])
    assert llm.last_stats is None or llm.last_stats.requests  # the main thread's own


def test_a_dropped_llm_is_freed_and_its_loop_thread_ends(tmp_path):
    """The loop thread must not keep an LLM (weights, KV cache) alive once dropped."""
    import gc
    import weakref

    write_tiny_llama4(tmp_path, seed=1)
    llm = chunklocal.LLM(tmp_path, max_model_len=64)
    assert len(llm.generate([[1, 2, 3]], max_new_tokens=3)[0]) == 3
    ref, thread = weakref.ref(llm), llm.core._thread
    del llm
    gc.collect()
    thread.join(10)
    assert ref() is None and not thread.is_alive()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # planted
def test_a_loop_thread_that_dies_fails_its_clients_instead_of_hanging(tmp_path, monkeypatch):
    """The loop thread died on the H200 (a bare 'cuda' device in set_device) and generate()
    waited for ever.  Any death now fails the running and queued requests with its cause,
    and the dead core refuses new ones."""
    from chunklocal.engine.core import EngineCore

    write_tiny_llama4(tmp_path, seed=0)
    llm = chunklocal.LLM(tmp_path, max_num_seqs=2, max_num_batched_tokens=32,
                         max_model_len=64)

    def broken(self, first):
        raise RuntimeError("loop broke")

    monkeypatch.setattr(EngineCore, "_iterate", broken)
    outcome = {}

    def call():
        try:
            llm.generate(prompts_for(0), max_new_tokens=4, use_tqdm=False)
        except RuntimeError as err:
            outcome["error"] = err

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(timeout=30)
    assert not caller.is_alive(), "generate() hung after the loop thread died"
    assert "loop broke" in str(outcome["error"])
    dead = llm._core
    with pytest.raises(RuntimeError, match="the engine loop died: RuntimeError"):
        dead.submit([])
    # llm.core starts a fresh core: it fails the same way while the loop is broken, and
    # serves again once it is not (the dead loop freed every page).
    with pytest.raises(RuntimeError, match="loop broke"):
        llm.generate(prompts_for(1), max_new_tokens=4, use_tqdm=False)
    monkeypatch.undo()
    assert [len(out) for out in llm.generate(prompts_for(2), max_new_tokens=4,
                                             use_tqdm=False)] == [4, 4, 4]
    assert all(g.num_free == g.num_blocks for g in llm.block_manager.groups)


@pytest.mark.parametrize("call", ["generate", "prompt_logits"])
def test_shutdown_during_a_token_list_call_raises_instead_of_cutting_it_short(
        ckpt, hold_steps, call):
    """The token-list forms carry no finish_reason: an abort must not look like an output."""
    import time

    llm = chunklocal.LLM(ckpt[0], max_model_len=128, max_num_batched_tokens=8)
    gate, entered = hold_steps(llm)
    result = {}

    def run():
        try:
            if call == "generate":
                result["out"] = llm.generate([[1, 2, 3]], max_new_tokens=50, ignore_eos=True)
            else:  # 40 prompt tokens in steps of 8: several steps
                result["out"] = llm.prompt_logits([list(range(1, 41))])
        except RuntimeError as err:
            result["err"] = err

    caller = threading.Thread(target=run)
    caller.start()
    assert entered.wait(30)
    # the core itself: ``llm.core`` makes a new one once this one is closed, so polling
    # it would wait out the deadline
    core = llm.core
    stopper = threading.Thread(target=llm.shutdown)
    stopper.start()
    deadline = time.monotonic() + 30
    while not core.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.set()
    stopper.join(30)
    caller.join(30)
    assert "out" not in result, "an aborted call returned as if complete"
    assert "aborted" in str(result["err"])


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux /proc only")
def test_library_threads_carry_their_names_to_the_os():
    """_threads.name_os_thread: top -H, /proc and py-spy show a library thread by its
    Python name less the package prefix (the load test's per-thread CPU reads them)."""
    from chunklocal._threads import name_os_thread

    seen = []

    def target():
        name_os_thread()
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text())

    thread = threading.Thread(target=target, name="chunklocal-engine-reader-long-name")
    thread.start()
    thread.join()
    assert seen == ["engine-reader-l\n"]
