"""Prefix caching that knows chunk windows (engine/prefix_cache.py, issue 21).

Two levels.  A fake model (scheduler + block manager, hypothesis): every KV slot records
the content of the prefix it was computed from, so a query reading a key of another
request's cached page must find the KV of its own prefix; block accounting is checked
before every step.  The tiny Llama-4 (tests/llama4_tiny.py): greedy and seeded outputs
equal with caching on and off (hybrid and merged KV, chunk/block boundaries, evictions,
preemptions, n > 1, speculative k = 3, async scheduling), and the hit sizes themselves.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_engine_scheduler import kv_groups, local_pages, next_token, run_to_end, unrolled

import chunklocal
from chunklocal._validate import cdiv
from chunklocal.engine.block_manager import BlockManager
from chunklocal.engine.sampling import SamplingParams
from chunklocal.engine.scheduler import Scheduler
from chunklocal.engine.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
VOCAB = 5


# -- block accounting -----------------------------------------------------------------------------
def check_accounting(manager: BlockManager, running) -> None:
    """Reference counts equal the block tables holding a page; no page both free (free
    stack or evictable) and in use; hashes consistent; every page somewhere."""
    for g, grp in enumerate(manager.groups):
        cache = grp.cache
        held = collections.Counter(p for s in running
                                   for p in s.block_tables[g][s.first_owned_page[g]:])
        free, evictable = set(grp.free_blocks), set(cache.evictable)
        assert len(free) == len(grp.free_blocks), "a page twice on the free stack"
        assert not free & evictable, "a page both free and evictable"
        assert not (free | evictable) & held.keys(), "a page in use is free"
        assert len(free) + len(evictable) + len(held) == grp.num_blocks, "a page leaked"
        assert cache.ref == [held[p] for p in range(grp.num_blocks)], "reference counts"
        assert all(cache.page_hash[p] is not None for p in evictable)
        assert all(cache.page_hash[p] is None for p in free)
        assert all(cache.page_hash[p] == h for h, p in cache.by_hash.items())
        assert len(cache.by_hash) == sum(h is not None for h in cache.page_hash)
        for s in running:  # the numpy mirrors
            row = manager.tables[g][s.row]
            assert row[:len(s.block_tables[g])].tolist() == s.block_tables[g]
            assert manager.num_pages[g, s.row] == len(s.block_tables[g])
            assert manager.first_owned[g, s.row] == s.first_owned_page[g]


def check_idle(manager: BlockManager) -> None:
    for grp in manager.groups:
        assert grp.num_free == grp.num_blocks, "a page not back when idle"
        assert grp.cache is None or not any(grp.cache.ref)
    assert len(manager.free_rows) == manager.tables[0].shape[0], "a table row not back"
    assert not manager.num_pages.any() and not manager.first_owned.any()


# -- fake model ---------------------------------------------------------------------------------


def prefix_codes(tokens) -> list[int]:
    """codes[p]: the KV of position p, a function of tokens[:p + 1] only."""
    codes, h = [], 17
    for t in tokens:
        h = hash((h, t))
        codes.append(h)
    return codes


class ContentRunner:
    """Writes every scheduled token's prefix code, then checks every key each query may
    read (after the whole step's writes, like a layer) holds its own prefix's code."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.groups = scheduler.block_manager.groups
        self.kv = [np.zeros((g.num_blocks, g.block_size), dtype=np.int64) for g in self.groups]

    def run(self, batch):
        check_accounting(self.scheduler.block_manager, self.scheduler.running)
        views = []
        for seq, n, draft in zip(batch.seqs, batch.num_new, batch.drafts, strict=True):
            view = seq.token_ids[:seq.num_computed + n - len(draft)] + draft
            codes = prefix_codes(view)
            views.append((view, codes))
            for g, grp in enumerate(self.groups):
                bs, table = grp.block_size, seq.block_tables[g]
                for pos in range(seq.num_computed, seq.num_computed + n):
                    self.kv[g][table[pos // bs], pos % bs] = codes[pos]
        sampled = []
        for seq, n, draft, (view, codes) in zip(batch.seqs, batch.num_new, batch.drafts, views,
                                                strict=True):
            start = seq.num_computed
            for g, grp in enumerate(self.groups):
                bs, table, c = grp.block_size, seq.block_tables[g], grp.chunk_size
                for p in range(start, start + n):
                    for key in range(0 if c is None else p // c * c, p + 1):
                        assert key // bs >= seq.first_owned_page[g], "reads a freed page"
                        assert self.kv[g][table[key // bs], key % bs] == codes[key], \
                            "a key holds another prefix's KV"
            if start + n - len(draft) >= len(seq):
                sampled.append(np.array([next_token(view[:start + n - len(draft) + j], VOCAB)
                                         for j in range(len(draft) + 1)]))
            else:
                sampled.append(np.zeros(0, dtype=np.int64))
        return sampled


def boundary_lengths(unit_pairs):
    """Lengths just before, at and after multiples of the block and chunk sizes."""
    return st.one_of(st.integers(1, 90), st.builds(
        lambda unit, k, d: max(1, unit * k + d), st.sampled_from(unit_pairs),
        st.integers(1, 5), st.integers(-1, 1)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), block_size=st.sampled_from([4, 8]),
       pages_per_chunk=st.sampled_from([1, 2, 4]), hybrid=st.booleans(),
       spec_k=st.sampled_from([0, 3]), max_num_seqs=st.integers(1, 5),
       budget=st.integers(1, 40), spare=st.integers(0, 10), max_new=st.integers(1, 8))
def test_fake_model_reads_only_its_own_prefix_kv(data, block_size, pages_per_chunk, hybrid,
                                                  spec_k, max_num_seqs, budget, spare, max_new):
    chunk = block_size * pages_per_chunk
    base = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=90, max_size=90))
    lengths = data.draw(st.lists(boundary_lengths([block_size, chunk]), min_size=1,
                                 max_size=8))
    suffixes = data.draw(st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=6),
                                  min_size=len(lengths), max_size=len(lengths)))
    prompts = [base[:n] + s for n, s in zip(lengths, suffixes, strict=True)]
    prompts += prompts[:data.draw(st.integers(0, 3))]  # exact repeats
    scheduler = run_fake(prompts, block_size, chunk, hybrid, spec_k, max_num_seqs, budget,
                         spare, spare // 2, max_new)
    manager = scheduler.block_manager
    event(f"hits: {manager.prefix_cache_hits > 0}, preempted: {scheduler.num_preemptions > 0}")


# -- the tiny Llama-4 ----------------------------------------------------------------------------
C = 32  # the tiny checkpoint's attention_chunk_size


@pytest.fixture(scope="module")
def path(ckpt):
    return ckpt[0]


_ENGINES: dict = {}


def engine(path, caching, **kwargs):
    """One engine per configuration for the module (the cache state carries over, which
    is more reuse); every step checks the block accounting."""
    key = (str(path), caching, tuple(sorted(kwargs.items())))
    if key not in _ENGINES:
        llm = chunklocal.LLM(path, enable_prefix_caching=caching, **kwargs)
        if caching:
            real_launch = llm.runner.launch

            def checked(batch, prev=None):  # every step, async scheduling or not
                check_accounting(llm.block_manager, llm.scheduler.running)
                return real_launch(batch, prev)

            llm.runner.launch = checked
        _ENGINES[key] = llm
    return _ENGINES[key]


def greedy(max_tokens=6, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_both(path, prompts, params, **kwargs):
    """Outputs with caching off and on (on: each prompt list twice, the second finds the
    first's pages); the caching engine's outputs."""
    off = engine(path, False, **kwargs).generate(prompts, params, use_tqdm=False)
    llm = engine(path, True, **kwargs)
    outs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]
    tokens = [[o.token_ids for o in r.outputs] for r in off]
    for out in outs:
        assert [[o.token_ids for o in r.outputs] for r in out] == tokens
    check_idle(llm.block_manager)
    return llm, outs


CONFIGS = [dict(block_size=4, hybrid_kv_cache=True, num_kv_blocks=64),  # evictions
           dict(block_size=8, hybrid_kv_cache=False, num_kv_blocks=40),
           dict(block_size=8, hybrid_kv_cache=True, num_kv_blocks=200)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data(), config=st.sampled_from(range(len(CONFIGS))))
def test_greedy_outputs_equal_caching_off(path, data, config):
    kwargs = dict(CONFIGS[config], max_model_len=160, max_num_seqs=4,
                  max_num_batched_tokens=48)
    bs = kwargs["block_size"]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    base = rng.integers(1, 512, 130).tolist()
    lengths = data.draw(st.lists(boundary_lengths([bs, C]), min_size=1, max_size=5))
    prompts = [base[:min(n, 130)] + rng.integers(1, 512, int(rng.integers(0, 4))).tolist()
               for n in lengths]
    llm, _ = run_both(path, prompts, greedy(), **kwargs)
    event(f"hits: {llm.block_manager.prefix_cache_hits > 0}, "
          f"preemptions: {llm.scheduler.num_preemptions > 0}")


def test_preemptions_n_seeded_and_speculative_equal_caching_off(path):
    rng = np.random.default_rng(3)
    base = rng.integers(1, 512, 100).tolist()
    prompts = [base[:n] + [7] * (i % 3) for i, n in enumerate([40, 65, 100, 33, 64, 97])]
    small = dict(block_size=4, num_kv_blocks=40, max_model_len=128, max_num_seqs=4,
                 max_num_batched_tokens=32)
    distinct = [rng.integers(1, 512, 60).tolist() for _ in range(3)]
    llm, _ = run_both(path, prompts + distinct, greedy(10), **small)  # this pool preempts
    assert llm.scheduler.num_preemptions > 0 and llm.block_manager.prefix_cache_hits > 0
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3)
    run_both(path, prompts[:3], sampled, block_size=8, max_model_len=160)
    copy = [(base[:12] * 8)[:n] for n in (40, 70, 95)]  # repetitive: drafts get accepted
    llm, _ = run_both(path, copy, greedy(12), block_size=8, max_model_len=160,
                      num_speculative_tokens=3)
    assert llm.scheduler.num_accepted > 0
    run_both(path, prompts, greedy(8), block_size=8, max_model_len=160, async_scheduling=True)


def test_second_identical_prompt_hits_whole_blocks_and_n_samples_share(path):
    llm = chunklocal.LLM(path, block_size=8, max_model_len=160)
    prompt = np.random.default_rng(1).integers(1, 512, 81).tolist()
    for n_tokens, expected in ((81, 80), (80, 72), (79, 72), (9, 8), (8, 0)):
        first = llm.generate([prompt[:n_tokens]], greedy(3), use_tqdm=False)[0]
        second = llm.generate([prompt[:n_tokens]], greedy(3), use_tqdm=False)[0]
        assert second.num_cached_tokens == expected  # at least one token computed
        assert second.outputs[0].token_ids == first.outputs[0].token_ids
    stats = llm.core.stats()
    assert stats["prefix_cache_hits_total"] == llm.block_manager.prefix_cache_hits > 0
    assert stats["prefix_cache_queries_total"] == llm.block_manager.prefix_cache_queries
    fresh = np.random.default_rng(2).integers(1, 512, 50).tolist()
    out = llm.generate([fresh], greedy(3, n=3), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # sample 0 computed the prompt ...
    hits = llm.block_manager.prefix_cache_hits
    llm.generate([fresh[:41]], greedy(1, n=2), use_tqdm=False)
    assert llm.block_manager.prefix_cache_hits - hits == 2 * 40  # ... samples share it
    off = chunklocal.LLM(path, block_size=8, max_model_len=160, enable_prefix_caching=False)
    assert off.generate([prompt], greedy(3), use_tqdm=False)[0].num_cached_tokens == 0
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        chunklocal.LLM(path, enable_prefix_caching="yes")


def _evict(grp, hashes) -> None:
    """Evict the cached pages of these block hashes (as allocation would)."""
    cache = grp.cache
    for h in hashes:
        page = cache.by_hash.pop(h)
        del cache.evictable[page]
        cache.page_hash[page] = None
        grp.free_blocks.append(page)


def test_chunked_group_needs_only_the_window_of_the_next_token(path):
    bs = 8
    llm = chunklocal.LLM(path, block_size=bs, max_model_len=160, max_num_batched_tokens=24)
    off = chunklocal.LLM(path, block_size=bs, max_model_len=160, enable_prefix_caching=False)
    prompt = np.random.default_rng(4).integers(1, 512, 90).tolist()  # P = 88, window [64, 88)
    want = off.generate([prompt], greedy(4), use_tqdm=False)[0].outputs[0].token_ids
    llm.generate([prompt], greedy(4), use_tqdm=False)
    groups = llm.block_manager.groups
    local = next(g for g in groups if g.chunk_size is not None)
    assert local.chunk_size == C and len(groups) == 2
    seq = Sequence(0, prompt, greedy(), 2)
    hashes = llm.block_manager._hashes(seq)
    _evict(local, [h for h in hashes[:64 // bs] if h in local.cache.by_hash])  # early chunks
    hit = llm.block_manager.lookup(seq)
    assert hit.num_tokens == 88
    assert hit.first == [0 if g.chunk_size is None else 64 // bs for g in groups]
    out = llm.generate([prompt], greedy(4), use_tqdm=False)[0]
    assert out.num_cached_tokens == 88 and out.outputs[0].token_ids == want
    # A window block gone: the hit falls back to the chunk boundary (an empty window).
    _evict(local, [hashes[80 // bs]])
    assert llm.block_manager.lookup(seq).num_tokens == 80
    _evict(local, [hashes[64 // bs]])
    assert llm.block_manager.lookup(seq).num_tokens == 64
    out = llm.generate([prompt], greedy(4), use_tqdm=False)[0]
    assert out.num_cached_tokens == 64 and out.outputs[0].token_ids == want
    check_idle(llm.block_manager)


def run_fake(prompts, block_size, chunk, hybrid, spec_k, max_num_seqs, budget, spare,
             local_spare, max_new):
    """Run ``prompts`` through the fake model twice (caching on); the scheduler."""
    max_model_len = max(map(len, prompts)) + max_new
    whole = cdiv(max_model_len, block_size)
    local = local_pages(chunk, budget, block_size, whole)
    groups = kv_groups(block_size, chunk, (whole + spare, local + local_spare) if hybrid
                       else (whole + spare,))
    manager = BlockManager(groups, max_num_seqs, whole, prefix_caching=True)
    scheduler = Scheduler(manager, max_num_seqs, budget, max_model_len, spec_k)
    params = SamplingParams(max_tokens=max_new, ignore_eos=True)
    runner = ContentRunner(scheduler)
    for _ in range(2):  # the second round finds the first one's evictable pages
        seqs = [Sequence(i, p, params, len(groups)) for i, p in enumerate(prompts)]
        for seq in seqs:
            scheduler.add(seq)
        run_to_end(scheduler, runner)
        for seq, prompt in zip(seqs, prompts, strict=True):
            assert seq.output_ids == unrolled(prompt, max_new, VOCAB)
            assert seq.num_cached_tokens <= (len(prompt) - 1) // block_size * block_size
        check_accounting(manager, [])
        check_idle(manager)
    return scheduler


@pytest.mark.parametrize("length", [5, 6, 7, 9, 13])
def test_decodes_sharing_stale_chunked_pages_in_a_full_pool(length):
    """Identical prompts share their chunk window's pages; decoding past the chunk end
    releases them as stale, which frees nothing while another request holds them: the
    vectorised decode check must not count them as free pages."""
    prompt = [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3][:length]
    for others in ([], [[4] * 3], [[4] * 7, [3] * 2]):
        for budget in (4, 8, 16):
            for local_spare in range(3):
                run_fake([prompt] * 3 + others, 4, 16, True, 0, 5, budget, 0, local_spare, 14)
