"""Generated tokens in the prefix cache (engine/prefix_cache.py, as vLLM): full blocks produced
during decode are registered too, so a follow-up turn that resends the answer hits them.

Fake model (every key read must hold its own prefix's KV) and the tiny Llama-4 (greedy
outputs equal with caching off, n > 1 samples each hitting only its own answer)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_prefix_cache import VOCAB, boundary_lengths, engine, greedy
from test_prefix_cache_accounting import drive, make_scheduler

from chunklocal._validate import cdiv
from chunklocal.engine.prefix_cache import extend_hashes
from chunklocal.engine.sampling import SamplingParams
from chunklocal.engine.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), block_size=st.sampled_from([2, 4]), hybrid=st.booleans(),
       spec_k=st.sampled_from([0, 2]), max_new=st.integers(1, 12), budget=st.integers(4, 32))
def test_a_follow_up_hits_the_blocks_of_the_answer(data, block_size, hybrid, spec_k, max_new,
                                                   budget):
    """Turn 2 resends turn 1's prompt and answer plus a question: with a pool that evicts
    nothing, it hits every full block turn 1 computed (prompt and answer)."""
    chunk = 2 * block_size
    lengths = data.draw(st.lists(boundary_lengths([block_size, chunk]), min_size=1,
                                 max_size=4))
    prompts = [[(7 * i + j + i // 3) % VOCAB for i in range(min(n, 30))]
               for j, n in enumerate(lengths)]
    max_len = 30 + 2 * max_new + 8
    whole = cdiv(max_len, block_size) * (2 * len(prompts) + 2)  # room for every block
    scheduler = make_scheduler(block_size, chunk, (whole, whole) if hybrid else (whole,), 4,
                               budget, spec_k, max_len=max_len)
    first = drive(scheduler, prompts, max_new)
    for s in first:  # every computed full block is cached in every group (even the chunked
        #              group's blocks released as stale when a decode crossed a chunk)
        chain = extend_hashes([], s.token_ids, block_size, (len(s) - 1) // block_size)
        for grp in scheduler.block_manager.groups:
            assert all(h in grp.cache.by_hash for h in chain), (len(s), grp.chunk_size)
    follow = [p + s.output_ids + [(len(p) + k) % VOCAB for k in range(1 + n % 3)]
              for n, (p, s) in enumerate(zip(prompts, first, strict=True))]
    second = drive(scheduler, follow, max_new)  # the fake model checks every key it reads
    for p, s, f in zip(prompts, second, follow, strict=True):
        computed = len(p) + max_new - 1  # turn 1's last token was sampled, never computed
        want = min(computed, len(f) - 1) // block_size * block_size
        assert s.num_cached_tokens == want, (len(p), len(f), s.num_cached_tokens, want)


C = 32  # the tiny checkpoint's attention_chunk_size


@pytest.fixture(scope="module")
def path(ckpt):
    return ckpt[0]


CONFIGS = [dict(block_size=4, hybrid_kv_cache=True, num_kv_blocks=64),  # evictions
           dict(block_size=8, hybrid_kv_cache=False, num_kv_blocks=40),
           dict(block_size=8, hybrid_kv_cache=True, num_kv_blocks=200)]


@settings(max_examples=12, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data(), config=st.sampled_from(range(len(CONFIGS))))
def test_multi_turn_greedy_outputs_equal_caching_off(path, data, config):
    kwargs = dict(CONFIGS[config], max_model_len=160, max_num_seqs=4,
                  max_num_batched_tokens=48)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    base = rng.integers(1, 512, 60).tolist()
    lengths = data.draw(st.lists(boundary_lengths([kwargs["block_size"], C]), min_size=1,
                                 max_size=3))
    prompts = [base[:min(n, 60)] for n in lengths]
    on, off = engine(path, True, **kwargs), engine(path, False, **kwargs)
    for _ in range(3):  # turns: each resends the conversation so far
        params = greedy(int(rng.integers(1, 14)))
        want = off.generate(prompts, params, use_tqdm=False)
        got = on.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        prompts = [p + list(o.outputs[0].token_ids) + rng.integers(1, 512, 3).tolist()
                   for p, o in zip(prompts, got, strict=True)]


def test_each_sample_hits_its_own_answer(path):
    llm = engine(path, True, block_size=8, max_model_len=160)
    off = engine(path, False, block_size=8, max_model_len=160)
    prompt = np.random.default_rng(7).integers(1, 512, 21).tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=1.0, seed=3, n=2),
                       use_tqdm=False)[0]
    answers = [list(o.token_ids) for o in out.outputs]
    assert answers[0][:3] != answers[1][:3]  # the samples part at once
    follow = [prompt + a + [5, 6] for a in answers]
    got = llm.generate(follow, greedy(4), use_tqdm=False)
    want = off.generate(follow, greedy(4), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.num_cached_tokens for o in got] == [40, 40]  # 21 + 20 - 1 computed: 5 blocks


def test_overlapped_steps_cache_the_answer_as_synchronous_ones(path):
    """With async_scheduling a decode's newest token is a placeholder while its block is
    scheduled: that block is registered later, never hashed with the placeholder.  Four
    decodes over a budget of two go request by request (each allocates every step)."""
    rng = np.random.default_rng(8)
    prompts = [rng.integers(1, 512, n).tolist() for n in (29, 30, 31, 32)]  # every phase
    cached = []
    for overlap in (False, True):
        llm = engine(path, True, block_size=4, max_model_len=160, async_scheduling=overlap,
                     max_num_batched_tokens=2)
        first = llm.generate(prompts, greedy(17), use_tqdm=False)
        follow = [p + list(o.outputs[0].token_ids) + [9]
                  for p, o in zip(prompts, first, strict=True)]
        cached.append([o.num_cached_tokens
                       for o in llm.generate(follow, greedy(2), use_tqdm=False)])
    assert cached == [[44, 44, 44, 48]] * 2  # n + 17 - 1 computed, in blocks of 4


def test_a_block_ending_in_a_placeholder_is_registered_once_its_token_is_known():
    manager = make_scheduler(4, 8, (30, 12), 2, 24, max_len=48).block_manager
    seq = Sequence(0, [1, 2, 3, 4, 0, 1, 2], SamplingParams(max_tokens=4), 2)
    manager.allocate(seq, 7)
    seq.num_computed = 7
    seq.token_ids.append(-1)  # an overlapped step's token, still on the device
    seq.placeholder_index = 7
    manager.allocate(seq, 1)  # position 7 ends block 1: its token is not known yet
    assert seq.num_registered == 1
    seq.token_ids[7], seq.placeholder_index, seq.num_computed = 3, None, 8
    seq.token_ids.append(4)
    manager.allocate(seq, 1)
    chain = extend_hashes([], seq.token_ids, 4, 2)
    assert seq.num_registered == 2 and seq.block_hashes == chain
    assert all(h in grp.cache.by_hash for grp in manager.groups for h in chain)
