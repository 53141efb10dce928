"""Prefix-cache block accounting under random workloads (engine/prefix_cache.py, issue 21).

The fake model of tests/test_prefix_cache.py (every KV slot holds the code of its own
prefix) drives the real scheduler and block manager.  Here: the vectorised decode check
(``BlockManager.decode_changes``) must never promise pages that the request-by-request
path could not hand out (checked on every call with the pool drained to every size), and
the accounting invariants (reference counts, no page both free and in use, table rows,
everything back when idle) hold after every step, preemption and abort.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_engine_scheduler import kv_groups, local_pages, unrolled
from test_prefix_cache import VOCAB, ContentRunner, boundary_lengths, check_accounting, check_idle

from chunklocal._validate import cdiv
from chunklocal.engine.block_manager import BlockManager
from chunklocal.engine.sampling import SamplingParams
from chunklocal.engine.scheduler import Scheduler
from chunklocal.engine.sequence import Sequence, Status

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def make_scheduler(block_size, chunk, pages, max_num_seqs, budget, spec_k=0, max_len=128):
    """``pages``: (global, chunked) pool sizes (hybrid), or (merged,)."""
    groups = kv_groups(block_size, chunk, pages)
    manager = BlockManager(groups, max_num_seqs, cdiv(max_len, block_size), prefix_caching=True)
    return Scheduler(manager, max_num_seqs, budget, max_len, spec_k)


def check_rows(scheduler) -> None:
    """Table rows: one per running request, the rest free; waiting requests hold nothing."""
    manager = scheduler.block_manager
    rows = [s.row for s in scheduler.running]
    assert None not in rows and len(set(rows)) == len(rows), "a table row shared or missing"
    assert not set(rows) & set(manager.free_rows), "a running request's row is free"
    assert len(manager.free_rows) + len(rows) == manager.tables[0].shape[0], "a row leaked"
    for seq in scheduler.waiting:
        assert seq.row is None and not any(seq.block_tables), "a waiting request holds pages"


def check_decode_changes_sound(manager: BlockManager, seqs) -> None:
    """With one group drained to ``keep`` available pages (every group, every ``keep``): when
    ``decode_changes`` answers, the request-by-request path (``can_allocate`` then
    ``allocate``, in order) gives every request its token's pages, and the positions it
    names are exactly the requests whose pages change.  Also with the requests that
    release stale pages first (the check's contract holds for any order)."""
    stale_first = sorted(seqs, key=lambda seq: -sum(
        grp.stale_pages(seq, g) for g, grp in enumerate(manager.groups)))
    for order in ([list(seqs), stale_first] if stale_first != list(seqs) else [list(seqs)]):
        for g, grp in enumerate(manager.groups):
            for keep in range(grp.num_free + 1):
                check_drained(manager, order, g, keep)


def check_drained(manager: BlockManager, seqs, g: int, keep: int) -> None:
    m, s = copy.deepcopy((manager, seqs), {id(manager.lock): manager.lock})  # one lock
    grp = m.groups[g]
    if grp.num_free > keep:  # an outside holder takes the rest (free stack, then evicted)
        grp.take(grp.num_free - keep)
    changes = BlockManager.decode_changes(m, s)
    if changes is None:
        return
    changed = []
    for i, seq in enumerate(s):
        assert m.can_allocate(seq, 1), \
            f"decode_changes promised pages that request {i} cannot get (group {g}: {keep} left)"
        before = ([list(t) for t in seq.block_tables], list(seq.first_owned_page))
        m.allocate(seq, 1)
        if before != ([list(t) for t in seq.block_tables], list(seq.first_owned_page)):
            changed.append(i)
    assert changes.tolist() == changed


def watch_decode_changes(manager: BlockManager) -> list[int]:
    """Check every decode_changes call of ``manager`` (see above); the calls, counted."""
    calls = [0]

    def checked(seqs):
        calls[0] += 1
        check_decode_changes_sound(manager, seqs)
        return BlockManager.decode_changes(manager, seqs)

    manager.decode_changes = checked
    return calls


def drive(scheduler, prompts, max_new, abort_at=(), seed=0) -> list[Sequence]:
    """Run ``prompts`` to the end through the fake model, checking the accounting and the
    rows after every step; ``abort_at``: step numbers after which one live request (drawn
    from ``seed``) is aborted, and all of them (``abort_all``) at a negative number."""
    manager = scheduler.block_manager
    runner = scheduler.__dict__.setdefault("runner", ContentRunner(scheduler))  # its KV stays
    rng = np.random.default_rng(seed)
    seqs = [Sequence(i, p, SamplingParams(max_tokens=max_new, ignore_eos=True),
                     len(manager.groups)) for i, p in enumerate(prompts)]
    for seq in seqs:
        scheduler.add(seq)
    for step in range(10_000):
        if not scheduler.has_work():
            break
        batch = scheduler.schedule()
        scheduler.postprocess(batch, runner.run(batch), frozenset())
        check_accounting(manager, scheduler.running)
        check_rows(scheduler)
        if -step in abort_at and step:
            scheduler.abort_all()
        elif step in abort_at:
            live = [s for s in seqs if s.status is not Status.FINISHED]
            if live:
                scheduler.abort(live[int(rng.integers(len(live)))])
        check_accounting(manager, scheduler.running)
        check_rows(scheduler)
    assert not scheduler.has_work()
    check_accounting(manager, [])
    check_idle(manager)
    assert len(manager.free_rows) == manager.tables[0].shape[0]
    assert not manager.num_pages.any() and not manager.first_owned.any()
    return seqs


def test_decode_check_counts_no_shared_stale_page_as_free():
    """A decodes past its chunk (bs 4, c 16): its stale pages 0-3 go, but C shares pages
    0-2 (its hit), so only page 3 comes back; D and E then need a page each from a full
    chunked pool.  Counting the shared pages as gains lets all three through at once and E
    finds no page; the request-by-request path preempts E instead."""
    a = [1, 2, 3, 4, 0] * 3 + [1, 2, 3]  # 18 tokens: decodes at 18, past the chunk at 16
    prompts = [a, a[:15], [4] * 4 + [3] * 4, [3] * 4 + [4] * 4]  # C hits a's blocks 0-2
    for pages, watched in (((12, 10), False), ((12, 10), True), ((12, 11), True),
                           ((13, 10), True)):  # chunked pool: A 5 + C 1 + D 2 + E 2
        scheduler = make_scheduler(4, 16, pages, 4, 40)
        calls = watch_decode_changes(scheduler.block_manager) if watched else [1]
        seqs = drive(scheduler, prompts, 6)  # unwatched: E's take finds no page
        assert calls[0] > 0
        assert [s.output_ids for s in seqs] == [unrolled(p, 6, VOCAB) for p in prompts]
    assert scheduler.block_manager.prefix_cache_hits > 0


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), block_size=st.sampled_from([2, 4]),
       pages_per_chunk=st.sampled_from([2, 4]), hybrid=st.booleans(),
       max_num_seqs=st.integers(2, 5), budget=st.integers(4, 40), spare=st.integers(0, 6),
       max_new=st.integers(1, 10))
def test_decode_check_is_sound_over_random_workloads(data, block_size, pages_per_chunk, hybrid,
                                                     max_num_seqs, budget, spare, max_new):
    """Prompts sharing prefixes of lengths around block and chunk boundaries, a small pool
    (evictions, preemptions): every decode_changes call is checked against the
    request-by-request path at every pool size, and the accounting after every step."""
    chunk = block_size * pages_per_chunk
    base = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=40, max_size=40))
    lengths = data.draw(st.lists(boundary_lengths([block_size, chunk]), min_size=2,
                                 max_size=6))
    prompts = [base[:min(n, 40)] + data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=3))
               for n in lengths]
    max_len = max(map(len, prompts)) + max_new
    whole = cdiv(max_len, block_size)
    local = local_pages(chunk, budget, block_size, whole) + spare // 2
    pages = (whole + spare, local) if hybrid else (whole + spare,)
    scheduler = make_scheduler(block_size, chunk, pages, max_num_seqs, budget, max_len=max_len)
    calls = watch_decode_changes(scheduler.block_manager)
    for _ in range(2):  # the second round finds the first one's evictable pages
        seqs = drive(scheduler, prompts, max_new)
        assert [s.output_ids for s in seqs] == [unrolled(p, max_new, VOCAB) for p in prompts]
    event(f"decode_changes calls: {min(calls[0], 1)}, "
          f"preempted: {scheduler.num_preemptions > 0}")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), block_size=st.sampled_from([2, 4]), hybrid=st.booleans(),
       spec_k=st.sampled_from([0, 2]), budget=st.integers(4, 24), spare=st.integers(0, 4),
       seed=st.integers(0, 2**16))
def test_accounting_holds_through_aborts_preemptions_and_evictions(data, block_size, hybrid,
                                                                   spec_k, budget, spare, seed):
    """Random aborts (one request, or every one with ``abort_all``, which forgets the
    cache) between steps of a preempting, evicting workload: after every step and abort
    the invariants hold, and every page and row is back at the end."""
    chunk = 2 * block_size
    base = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=30, max_size=30))
    lengths = data.draw(st.lists(boundary_lengths([block_size, chunk]), min_size=2,
                                 max_size=6))
    prompts = [base[:min(n, 30)] + [i % VOCAB] for i, n in enumerate(lengths)]
    abort_at = set(data.draw(st.lists(st.integers(-12, 12), max_size=4)))
    max_len = max(map(len, prompts)) + 6
    whole = cdiv(max_len, block_size)
    local = min(cdiv(chunk - 1 + budget + spec_k, block_size), whole) + spare
    pages = (whole + spare, local) if hybrid else (whole + spare,)
    scheduler = make_scheduler(block_size, chunk, pages, 4, budget, spec_k, max_len=max_len)
    for round_ in range(2):
        seqs = drive(scheduler, prompts, 6, abort_at if round_ == 0 else (), seed)
        if round_:
            assert [s.output_ids for s in seqs] == [unrolled(p, 6, VOCAB) for p in prompts]
    event(f"preempted: {scheduler.num_preemptions > 0}, "
          f"hits: {scheduler.block_manager.prefix_cache_hits > 0}")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), block_size=st.sampled_from([2, 4]),
       pages_per_chunk=st.sampled_from([2, 4]), k=st.integers(1, 2), spare=st.integers(0, 4),
       max_new=st.integers(1, 8))
def test_decode_check_with_requests_sharing_a_crossed_chunk(data, block_size, pages_per_chunk,
                                                            k, spare, max_new):
    """The shape that shares stale pages: A's prompt crosses the chunk boundary k * c, C's
    prompt (a prefix of A's) ends inside chunk k - 1, so C's hit shares A's pages of that
    chunk when both are admitted in one step; A's first decode releases them as stale
    while C holds them.  Other requests of random lengths decode beside them (they need
    pages at block boundaries), and every decode_changes call is checked drained."""
    c = block_size * pages_per_chunk
    length_a = data.draw(st.integers(k * c, k * c + c - 1))
    length_c = data.draw(st.integers((k - 1) * c + block_size + 1, k * c))
    a = [(3 * i + i // 5) % VOCAB for i in range(length_a)]
    lengths = data.draw(st.lists(st.one_of(  # whole blocks: a page needed at the next step
        st.integers(1, 2 * pages_per_chunk).map(lambda m: m * block_size),
        st.integers(1, 2 * c)), min_size=1, max_size=4))
    others = [[(j + i) % VOCAB for i in range(n)] for j, n in enumerate(lengths)]
    prompts = [a, a[:length_c], *others]
    order = data.draw(st.permutations(range(2, len(prompts))))
    prompts = prompts[:2] + [prompts[i] for i in order]
    max_len = max(map(len, prompts)) + max_new
    whole = cdiv(max_len, block_size)
    budget = sum(map(len, prompts))
    need = sum(cdiv(len(p) + 1, block_size) for p in prompts)
    pages = (need + spare, need - cdiv(length_c, block_size) + data.draw(st.integers(0, 3)))
    scheduler = make_scheduler(block_size, c, (max(pages[0], whole), max(pages[1], whole)),
                               len(prompts), budget, max_len=max_len)
    watch_decode_changes(scheduler.block_manager)
    seqs = drive(scheduler, prompts, max_new)
    assert [s.output_ids for s in seqs] == [unrolled(p, max_new, VOCAB) for p in prompts]
    event(f"hits: {scheduler.block_manager.prefix_cache_hits > 0}")
