"""``LLM.reset_prefix_cache()`` and POST /reset_prefix_cache (vLLM's, issue 21): every cached
block forgotten when no request holds KV pages; False, with nothing forgotten, while one does;
the route only with VLLM_SERVER_DEV_MODE=1 (vLLM's dev routes), 200 either way as vLLM's."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest
from test_prefix_cache import check_accounting, check_idle, greedy
from test_prefix_cache_accounting import drive, make_scheduler

import chunklocal
from chunklocal.engine.block_manager import BlockManager
from chunklocal.engine.sampling import SamplingParams
from chunklocal.engine.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def cached_blocks(manager: BlockManager) -> int:
    return sum(len(grp.cache.by_hash) for grp in manager.groups if grp.cache is not None)


def test_llm_reset_forgets_cached_blocks_only_when_no_request_holds_pages(ckpt, hold_steps):
    llm = chunklocal.LLM(ckpt[0], block_size=8, max_model_len=160)
    prompt = np.random.default_rng(5).integers(1, 512, 70).tolist()
    want = llm.generate([prompt], greedy(4), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate([prompt], greedy(4), use_tqdm=False)[0].num_cached_tokens == 64
    manager = llm.block_manager
    assert cached_blocks(manager) > 0
    gate, entered = hold_steps(llm)  # a request in flight holds pages: nothing is reset
    done = []
    worker = threading.Thread(target=lambda: done.append(
        llm.generate([prompt], greedy(4), use_tqdm=False)[0]))
    worker.start()
    assert entered.wait(30)
    before = cached_blocks(manager)
    assert llm.reset_prefix_cache() is False and cached_blocks(manager) == before
    gate.set()
    worker.join(30)
    assert done[0].num_cached_tokens == 64 and done[0].outputs[0].token_ids == want
    assert llm.reset_prefix_cache() is True  # idle: every block forgotten, every page free
    assert cached_blocks(manager) == 0
    check_idle(manager)
    check_accounting(manager, [])
    again = llm.generate([prompt], greedy(4), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == want
    assert llm.generate([prompt], greedy(4), use_tqdm=False)[0].num_cached_tokens == 64
    off = chunklocal.LLM(ckpt[0], block_size=8, max_model_len=160, enable_prefix_caching=False)
    assert off.reset_prefix_cache() is True  # nothing cached, nothing in use


def test_a_reset_waits_for_an_admission_between_lookup_and_allocate():
    """A reset from another thread that arrives while the engine admits a hit (lookup done,
    pages not yet shared) must wait for the admission: it then finds the pages held (False),
    and the hit's pages are the KV the request reads (the fake model checks every key)."""
    scheduler = make_scheduler(4, 8, (30, 12), 2, 24, max_len=48)
    manager = scheduler.block_manager
    prompt = [(3 * i + i // 7) % 5 for i in range(21)]
    drive(scheduler, [prompt], 3)  # cached, evictable
    assert cached_blocks(manager) > 0
    box, real_lookup = {}, manager.lookup

    def lookup_then_reset(seq):
        hit = real_lookup(seq)
        if hit is not None and "thread" not in box:
            box["thread"] = threading.Thread(
                target=lambda: box.update(reset=manager.reset_prefix_cache()))
            box["thread"].start()
            box["thread"].join(0.3)  # blocked on the admission's lock (else it resets now)
            box["early"] = not box["thread"].is_alive()  # it reset inside the admission
        return hit

    def decode_changes_after_the_reset(seqs):  # the next step: the request holds its pages
        box["thread"].join(10)
        return BlockManager.decode_changes(manager, seqs)

    manager.lookup = lookup_then_reset
    manager.decode_changes = decode_changes_after_the_reset
    seqs = drive(scheduler, [prompt], 3)
    assert not box["early"] and box["reset"] is False and seqs[0].num_cached_tokens == 20
    assert manager.reset_prefix_cache() is True and cached_blocks(manager) == 0


def test_reset_while_a_request_runs_keeps_its_pages():
    scheduler = make_scheduler(4, 8, (30, 12), 2, 24, max_len=48)
    manager = scheduler.block_manager
    seq = Sequence(0, list(range(9)), SamplingParams(max_tokens=2), len(manager.groups))
    manager.allocate(seq, 9)
    assert cached_blocks(manager) > 0 and manager.reset_prefix_cache() is False
    assert cached_blocks(manager) > 0
    check_accounting(manager, [seq])
    manager.free(seq)
    assert manager.reset_prefix_cache() is True and cached_blocks(manager) == 0
    check_idle(manager)


@pytest.mark.parametrize("dev_mode", ["1", "0", None])
def test_reset_route_only_in_dev_mode(serve, tokenizer, monkeypatch, dev_mode):
    from fake_core import FakeCore

    if dev_mode is None:
        monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    else:
        monkeypatch.setenv("VLLM_SERVER_DEV_MODE", dev_mode)
    core = FakeCore(tokenizer)
    answers = [True, False]
    core.llm = types.SimpleNamespace(reset_prefix_cache=lambda: answers.pop(0))
    served = serve(core)
    codes = [served.client.post("/reset_prefix_cache").status_code for _ in range(2)]
    if dev_mode == "1":
        assert codes == [200, 200] and answers == []  # vLLM's: 200 whether or not it reset
    else:
        assert codes == [404, 404] and answers == [True, False]
