"""Several threads calling ``LLM.generate`` / ``prompt_logits`` on one LLM (issue 13).

Oracle: each call's own sequential greedy run on the same engine (greedy float32 on the
CPU is batch-invariant here: the engine already matches transformers one prompt at a
time, see test_engine.py).  Before the engine core, two threads cut one thread's
outputs to 3 of 20 tokens and gave the other an unrelated numpy error.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from llama4_tiny import write_tiny_llama4

import chunklocal


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama4_threads")
    write_tiny_llama4(path, seed=0)
    return chunklocal.LLM(path, max_num_seqs=4, max_num_batched_tokens=48, max_model_len=160)


def prompts_for(call: int, count: int = 3):
    rng = random.Random(call)
    return [[rng.randrange(512) for _ in range(rng.randrange(3, 60))] for _ in range(count)]


def run_threads(target, num_threads):
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
        thread.join(timeout=120)
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
    assert all(len(g.free_blocks) == g.num_blocks for g in llm.groups)
