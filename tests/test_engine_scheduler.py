"""Scheduler + block manager under random workloads, with a fake model (hypothesis).

The fake model's next token is a fixed function of the whole prefix, so the
right output of every request is known without the engine.  A fake KV store
records which (request, position, token) each slot holds; every step checks
that every key a query may see (its chunk for chunked groups, everything for
global ones) is still there, uncorrupted by frees, reuse or preemption.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from chunklocal._validate import cdiv
from chunklocal.engine.block_manager import BlockManager, KVGroup
from chunklocal.engine.sampling import SamplingParams
from chunklocal.engine.scheduler import Scheduler, propose_ngram
from chunklocal.engine.sequence import Sequence, Status
from chunklocal.kv_spec import ChunkedLocalAttentionSpec, FullAttentionSpec, merge

VOCAB = 11


def next_token(prefix, vocab: int = VOCAB) -> int:
    """The fake model's greedy token after ``prefix`` (tests/test_prefix_cache.py too)."""
    return (sum(prefix) * 7 + len(prefix) * 3) % vocab


def unrolled(prompt, max_new, vocab: int = VOCAB):
    tokens = list(prompt)
    for _ in range(max_new):
        tokens.append(next_token(tokens, vocab))
    return tokens[len(prompt):]


def code(seq_id, pos, token):
    return (seq_id * 100_000 + pos) * VOCAB + token + 1


class FakeRunner:
    """Writes and checks fake KV like the real runner's slot mapping, then 'samples'."""

    def __init__(self, groups, scheduler, limits):
        self.groups, self.scheduler, self.limits = groups, scheduler, limits
        self.kv = [np.zeros((g.num_blocks, g.block_size), dtype=np.int64) for g in groups]
        self.preempt_seen = 0

    def check_ownership(self):
        for g, grp in enumerate(self.groups):
            owned = [p for s in self.scheduler.running
                     for p in s.block_tables[g][s.first_owned_page[g]:]]
            assert len(owned) == len(set(owned)), "a page owned twice"
            assert not set(owned) & set(grp.free_blocks), "an owned page is free"
            assert len(owned) + grp.num_free == grp.num_blocks, "a page leaked"
            # The numpy row mirrors the request's list (placeholders included).
            manager = self.scheduler.block_manager
            for s in self.scheduler.running:
                row = manager.tables[g][s.row]
                assert row[:len(s.block_tables[g])].tolist() == s.block_tables[g]
                assert not row[len(s.block_tables[g]):].any()
                assert manager.num_pages[g, s.row] == len(s.block_tables[g])
                assert manager.first_owned[g, s.row] == s.first_owned_page[g]

    def run(self, batch):
        max_seqs, max_tokens = self.limits
        assert 0 < batch.num_tokens <= max_tokens
        assert len(self.scheduler.running) <= max_seqs
        self.check_ownership()
        sampled = []
        for seq, n, draft in zip(batch.seqs, batch.num_new, batch.drafts, strict=True):
            view = seq.token_ids[:seq.num_computed + n - len(draft)] + draft
            start = seq.num_computed
            for g, grp in enumerate(self.groups):
                bs, table = grp.block_size, seq.block_tables[g]
                assert len(table) >= cdiv(start + n, bs)
                for pos in range(start, start + n):
                    self.kv[g][table[pos // bs], pos % bs] = code(seq.seq_id, pos, view[pos])
                for p in range(start, start + n):
                    first = 0 if grp.chunk_size is None else (p // grp.chunk_size) * grp.chunk_size
                    for key in range(first, p + 1):
                        assert key // bs >= seq.first_owned_page[g], "reads a freed page"
                        stored = self.kv[g][table[key // bs], key % bs]
                        assert stored == code(seq.seq_id, key, view[key]), "KV corrupted"
            if start + n - len(draft) >= len(seq):
                sampled.append(np.array([next_token(view[:start + n - len(draft) + j])
                                         for j in range(len(draft) + 1)]))
            else:
                sampled.append(np.zeros(0, dtype=np.int64))
        return sampled


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 70), min_size=1, max_size=10),
    max_new=st.integers(1, 12),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 48),
    block_size=st.sampled_from([4, 8]),
    pages_per_chunk=st.sampled_from([1, 2, 4]),
    spec_k=st.integers(0, 3),
    hybrid=st.booleans(),
    spare_blocks=st.integers(0, 12),
    seed=st.integers(0, 1000),
)
def test_random_workloads_finish_with_right_tokens(lengths, max_new, max_num_seqs, budget,
                                                   block_size, pages_per_chunk, spec_k,
                                                   hybrid, spare_blocks, seed):
    scheduler, runner, prompts = workload(lengths, max_new, max_num_seqs, budget, block_size,
                                          pages_per_chunk, hybrid, spare_blocks, seed, spec_k)
    groups, seqs = scheduler.block_manager.groups, list(scheduler.waiting)
    run_to_end(scheduler, runner)
    event(f"preempted: {scheduler.num_preemptions > 0}")
    event(f"drafts accepted: {scheduler.num_accepted > 0}")
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.output_ids == unrolled(prompt, max_new)
    for grp in groups:
        assert grp.num_free == grp.num_blocks


def test_preemption_happens_and_recovers():
    """A pool of exactly one whole request with 4 concurrent requests must preempt."""
    block_size, max_new = 4, 10
    spec = FullAttentionSpec(block_size, 1, 8, torch.float32)
    prompts = [[1, 2, 0, 1, 2] * 3, [2, 2, 1] * 4, [0, 1] * 7, [1] * 9]
    max_model_len = max(map(len, prompts)) + max_new
    groups = [KVGroup(spec, cdiv(max_model_len, block_size))]
    scheduler = Scheduler(BlockManager(groups, 4, groups[0].num_blocks), 4, 64, max_model_len, 0)
    runner = FakeRunner(groups, scheduler, (4, 64))
    seqs = [Sequence(i, p, SamplingParams(max_tokens=max_new, ignore_eos=True), 1)
            for i, p in enumerate(prompts)]
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.has_work():
        batch = scheduler.schedule()
        scheduler.postprocess(batch, runner.run(batch), frozenset())
    assert scheduler.num_preemptions > 0
    assert [s.output_ids for s in seqs] == [unrolled(p, max_new) for p in prompts]
    # The pool was used to its last page and every page came back.
    assert groups[0].peak_used == groups[0].num_blocks
    assert len(groups[0].free_blocks) == groups[0].num_blocks


@given(tokens=st.lists(st.integers(0, 4), min_size=0, max_size=30), k=st.integers(0, 5))
@settings(max_examples=200, deadline=None)
def test_ngram_proposal_is_a_continuation_of_an_earlier_match(tokens, k):
    draft = propose_ngram(tokens, k)
    assert len(draft) <= k
    if not draft:
        # No proposal only if k == 0 or the last token never occurred before.
        assert k == 0 or len(tokens) < 2 or tokens[-1] not in tokens[:-1] or \
            tokens.index(tokens[-1]) == len(tokens) - 1
        return
    # Some earlier occurrence of a suffix of length >= 1 is followed by the draft.
    found = False
    for n in range(1, 4):
        for i in range(len(tokens) - n):
            if tokens[i:i + n] == tokens[-n:] and tokens[i + n:i + n + len(draft)] == draft:
                found = True
    assert found


# -- deterministic edges: drafts against the budget and EOS, pools that cannot progress ----

def decoding(prompts, k, ignore_eos=True, num_blocks=64):
    """A scheduler whose requests finished their prefill (one token sampled) and decode next."""
    spec = FullAttentionSpec(4, 1, 8, torch.float32)
    groups = [KVGroup(spec, num_blocks)]
    scheduler = Scheduler(BlockManager(groups, len(prompts), 16), len(prompts), 256, 64, k)
    seqs = [Sequence(i, p, SamplingParams(max_tokens=16, ignore_eos=ignore_eos), 1)
            for i, p in enumerate(prompts)]
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule()
    scheduler.postprocess(batch, [np.array([1]) for _ in seqs], frozenset())
    assert all(not s.is_prefilling for s in seqs)
    return scheduler, seqs


@pytest.mark.parametrize("budget, expected", [
    (9, [4, 4]), (8, [4, 4]), (7, [4, 3]), (6, [4, 2]), (5, [4, 1]), (4, [4]), (3, [3]),
    (2, [2]), (1, [1]),
])
def test_drafts_are_cut_to_the_token_budget(budget, expected):
    """Two decodes, each with a 3-token draft (4 query tokens): the second gets what the
    first leaves, one query token plus at most budget - 1 drafts, never more."""
    scheduler, _ = decoding([[1, 2, 3, 4], [4, 3, 2, 1]], k=3)
    scheduler.max_num_batched_tokens = budget
    scheduler._draft = lambda seq: [7, 7, 7]
    batch = scheduler.schedule()
    assert batch.num_new == expected
    assert [len(d) for d in batch.drafts] == [n - 1 for n in expected]
    assert batch.num_tokens <= budget


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_eos_arriving_as_an_accepted_draft_token_stops_the_request(ignore_eos):
    eos = 9
    scheduler, (seq,) = decoding([[1, 2, 3, 4]], k=3, ignore_eos=ignore_eos)
    scheduler._draft = lambda seq: [5, eos, 6]
    batch = scheduler.schedule()
    assert batch.drafts == [[5, eos, 6]]
    # The model agrees with all three draft tokens and picks 8 after them.
    finished = scheduler.postprocess(batch, [np.array([5, eos, 6, 8])], frozenset([eos]))
    if ignore_eos:
        assert seq.output_ids == [1, 5, eos, 6, 8] and not finished
        return
    assert seq.output_ids == [1, 5, eos]  # nothing after the EOS
    assert finished == [seq] and seq.status is Status.FINISHED
    assert not scheduler.has_work()
    grp = scheduler.block_manager.groups[0]
    assert grp.num_free == grp.num_blocks


def test_a_pool_that_cannot_hold_the_next_request_raises_instead_of_spinning():
    groups = [KVGroup(FullAttentionSpec(4, 1, 8, torch.float32), 2)]  # 8 tokens
    scheduler = Scheduler(BlockManager(groups, 1, 8), 1, 64, 32, 0)
    scheduler.add(Sequence(0, list(range(9)), SamplingParams(max_tokens=4, ignore_eos=True), 1))
    with pytest.raises(RuntimeError, match=r"no request can be scheduled \(1 waiting, 0 running"):
        scheduler.schedule()


def test_requests_that_keep_losing_their_kv_raise_instead_of_looping():
    """3 pages of 4 tokens, a 9-token prompt + 10 new tokens (5 pages), 4 tokens per step:
    each prefill piece is admitted, the decode at position 12 never fits, the request
    preempts itself and starts again: a livelock with a non-empty batch every step."""
    groups = [KVGroup(FullAttentionSpec(4, 1, 8, torch.float32), 3)]
    scheduler = Scheduler(BlockManager(groups, 1, 8), 1, 4, 32, 0)
    runner = FakeRunner(groups, scheduler, (1, 4))
    scheduler.add(Sequence(0, list(range(9)), SamplingParams(max_tokens=10, ignore_eos=True), 1))
    steps = 0
    with pytest.raises(RuntimeError, match="no new token in 38 steps .* preemptions"):
        while scheduler.has_work():
            batch = scheduler.schedule()
            steps += 1
            scheduler.postprocess(batch, runner.run(batch), frozenset())
    assert scheduler.num_preemptions > 0 and steps < 60


def kv_groups(block_size: int, chunk: int, pages) -> list[KVGroup]:
    """Fake KV groups (one KV head of 8, float32): ``pages`` is (global, chunked) pool sizes
    for hybrid KV, or (merged,) for one group of every layer."""
    geometry = (block_size, 1, 8, torch.float32)
    chunked = ChunkedLocalAttentionSpec(*geometry, attention_chunk_size=chunk)
    full = FullAttentionSpec(*geometry)
    if len(pages) == 2:
        return [KVGroup(full, pages[0]), KVGroup(chunked, pages[1])]
    return [KVGroup(merge([chunked, full]), pages[0])]


def local_pages(chunk: int, budget: int, block_size: int, whole: int) -> int:
    """Pages a chunked group holds for one request at most: its chunk and one step's
    tokens, never more than the whole request's."""
    return min(cdiv(chunk - 1 + budget, block_size), whole)


def run_to_end(scheduler, runner) -> None:
    """Step ``scheduler`` with ``runner``'s tokens until no request is left (and say so)."""
    for _ in range(10_000):
        if not scheduler.has_work():
            break
        batch = scheduler.schedule()
        scheduler.postprocess(batch, runner.run(batch), frozenset())
    assert not scheduler.has_work()


def workload(lengths, max_new, max_num_seqs, budget, block_size, pages_per_chunk, hybrid,
             spare_blocks, seed, spec_k=0, held=0):
    """A scheduler holding random repetitive prompts (so that prompt lookup finds drafts,
    some of them right), its fake runner, and the prompts.  The last ``held`` requests are
    not added: they are the ``held`` attribute of the runner, for the test to add later."""
    rng = np.random.default_rng(seed)
    chunk = block_size * pages_per_chunk
    max_model_len = max(lengths) + max_new
    whole = cdiv(max_model_len, block_size)
    local = local_pages(chunk, budget, block_size, whole)
    groups = kv_groups(block_size, chunk, (whole + spare_blocks, local + spare_blocks // 2)
                       if hybrid else (whole + spare_blocks,))
    scheduler = Scheduler(BlockManager(groups, max_num_seqs, whole), max_num_seqs, budget,
                          max_model_len, spec_k)
    prompts = [rng.integers(0, 3, n).tolist() for n in lengths]
    params = SamplingParams(max_tokens=max_new, ignore_eos=True)
    seqs = [Sequence(i, p, params, len(groups)) for i, p in enumerate(prompts)]
    for seq in seqs[:len(seqs) - held]:
        scheduler.add(seq)
    runner = FakeRunner(groups, scheduler, (max_num_seqs, budget))
    runner.held = seqs[len(seqs) - held:]
    return scheduler, runner, prompts


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    max_new=st.integers(1, 20),
    max_num_seqs=st.integers(1, 12),
    budget=st.integers(1, 48),
    block_size=st.sampled_from([1, 2, 4]),
    pages_per_chunk=st.sampled_from([1, 2, 3]),
    hybrid=st.booleans(),
    spare_blocks=st.integers(0, 6),
    seed=st.integers(0, 1000),
)
def test_decodes_scheduled_at_once_equal_the_request_by_request_loop(**shape):
    """The vectorised decode pass (Scheduler._decodes_at_once) against the loop it skips,
    in lockstep on the same workload: same batches, same pages, same preemptions."""
    fast, fast_runner, _ = workload(**shape)
    slow, slow_runner, _ = workload(**shape)
    slow._decodes_at_once = lambda *args: False
    taken = 0
    for _ in range(10_000):
        if not fast.has_work():
            break
        a, b = fast.schedule(), slow.schedule()
        assert [s.seq_id for s in a.seqs] == [s.seq_id for s in b.seqs]
        assert a.num_new == b.num_new and a.drafts == b.drafts
        taken += sum(n == 1 for n in a.num_new)
        for ga, gb in zip(fast.block_manager.groups, slow.block_manager.groups, strict=True):
            assert ga.free_blocks == gb.free_blocks and ga.peak_used == gb.peak_used
        for sa, sb in zip(fast.running, slow.running, strict=True):
            assert sa.block_tables == sb.block_tables and sa.row == sb.row
        assert fast.num_preemptions == slow.num_preemptions
        fast.postprocess(a, fast_runner.run(a), frozenset())
        slow.postprocess(b, slow_runner.run(b), frozenset())
    assert not slow.has_work()
    event(f"preempted: {fast.num_preemptions > 0}")


def test_decode_pages_are_checked_in_order_not_in_total():
    """Request ``first`` needs a page while the pool is empty; ``second`` frees two stale
    ones only after it.  In total the pool suffices, in order it does not: the vectorised
    pass must hand the step to the loop (which preempts) rather than allocate."""
    spec = ChunkedLocalAttentionSpec(2, 1, 8, torch.float32, attention_chunk_size=4)
    grp = KVGroup(spec, 4)
    manager = BlockManager([grp], 2, 8)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first, second = Sequence(0, [1] * 3, params, 1), Sequence(1, [1] * 5, params, 1)
    manager.allocate(first, 2)   # positions 0-1: one page; position 2 needs a second
    first.num_computed = 2
    manager.allocate(second, 5)  # positions 0-4: three pages
    second.num_computed = 4      # position 4 is in chunk 1: pages 0 and 1 are stale
    assert len(grp.free_blocks) == 0
    assert manager.decode_changes([first, second]) is None
    assert manager.decode_changes([second, first]).tolist() == [0, 1]


@pytest.mark.parametrize("threshold", [1, 5, 16])
def test_long_prefill_token_threshold_caps_each_prompt_per_step(threshold):
    """vLLM's long_prefill_token_threshold: no request prefills more than that many prompt
    tokens in one step, running or newly admitted, so the budget is shared; the outputs are
    those of the uncapped scheduler."""
    budget, max_new = 48, 6
    lengths = [40, 33, 7, 25]
    outs = {}
    for cap in (0, threshold):
        scheduler, runner, prompts = workload(lengths, max_new, 4, budget, 4, 2, True, 4, seed=3)
        scheduler.prefill_cap = cap or budget
        seqs, largest = list(scheduler.waiting), 0
        while scheduler.has_work():
            batch = scheduler.schedule()
            for seq, n in zip(batch.seqs, batch.num_new, strict=True):
                if seq.num_computed < seq.num_prompt_tokens:  # a prefill piece
                    largest = max(largest, n)
            scheduler.postprocess(batch, runner.run(batch), frozenset())
        outs[cap] = largest
        assert [s.output_ids for s in seqs] == [unrolled(p, max_new) for p in prompts]
    assert outs[threshold] == threshold < outs[0]  # capped, where the plain run was not


def test_the_threshold_reaches_the_scheduler_and_is_checked(tmp_path):
    from llama4_tiny import write_tiny_llama4

    import chunklocal

    write_tiny_llama4(tmp_path, seed=0)
    llm = chunklocal.LLM(tmp_path, device="cpu", dtype=torch.float32, max_model_len=128,
                         block_size=4, long_prefill_token_threshold=8)
    assert llm.scheduler.prefill_cap == 8
    plain = chunklocal.LLM(tmp_path, device="cpu", dtype=torch.float32, max_model_len=128,
                           block_size=4)
    prompts = [[(5 * i + 3 * j) % 400 + 7 for j in range(n)] for i, n in enumerate([30, 9])]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert max(llm.runner.tokens_per_step) <= 8 * len(prompts)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0.*-1"):
        chunklocal.LLM(tmp_path, device="cpu", long_prefill_token_threshold=-1)


def prompt_backlog(scheduler) -> int:
    """Prompt tokens not yet computed, summed request by request (the scheduler keeps the
    waiting part as a running count)."""
    return (sum(len(s.token_ids) for s in scheduler.waiting)
            + sum(s.num_uncomputed for s in scheduler.running if s.is_prefilling))


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=2, max_size=12),
    held=st.integers(0, 11),
    max_new=st.integers(1, 16),
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(1, 48),
    block_size=st.sampled_from([2, 4]),
    hybrid=st.booleans(),
    spare_blocks=st.integers(0, 8),
    steps=st.integers(1, 4),
    min_tokens=st.integers(1, 12),
    seed=st.integers(0, 1000),
)
def test_paced_prefills_take_their_share_of_the_backlog_and_lose_nothing(
        lengths, held, max_new, max_num_seqs, budget, block_size, hybrid, spare_blocks, steps,
        min_tokens, seed):
    """prefill_pacing_steps: a step that carries decodes takes at most
    max(ceil(backlog / steps), min) prompt tokens; requests arriving mid-run (one a step)
    and preemptions keep the waiting count exact; every output is the unpaced one."""
    held = min(held, len(lengths) - 1)
    scheduler, runner, prompts = workload(lengths, max_new, max_num_seqs, budget, block_size,
                                          2, hybrid, spare_blocks, seed, held=held)
    scheduler.prefill_pacing_steps, scheduler.pacing_min_tokens = steps, min_tokens
    seqs, late = list(scheduler.waiting) + runner.held, list(runner.held)
    paced = 0
    for _ in range(10_000):
        if late:
            scheduler.add(late.pop(0))
        if not scheduler.has_work():
            break
        backlog = prompt_backlog(scheduler)
        assert scheduler.waiting_tokens == sum(len(s.token_ids) for s in scheduler.waiting)
        decodes = {s.seq_id for s in scheduler.running if not s.is_prefilling}
        batch = scheduler.schedule()
        prompt = sum(n for s, n in zip(batch.seqs, batch.num_new, strict=True)
                     if s.seq_id not in decodes)
        if decodes:
            assert prompt <= max(-(-backlog // steps), min_tokens)
            paced += prompt < min(backlog, budget - len(decodes))
        scheduler.postprocess(batch, runner.run(batch), frozenset())
    assert not scheduler.has_work() and not late
    event(f"a step held prompt tokens back: {paced > 0}")
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.output_ids == unrolled(prompt, max_new)
    for grp in scheduler.block_manager.groups:
        assert grp.num_free == grp.num_blocks


@pytest.mark.parametrize("steps, expected", [(0, [2044, 4]), (2, [1024, 512, 256, 256]),
                                             (4, [512, 384, 288, 256, 256, 256, 96])])
def test_pacing_spreads_prompts_that_arrive_together(steps, expected):
    """Four requests decode when two 1024-token prompts arrive at once (budget 2048).
    Unpaced, one step takes 2044 prompt tokens and the next 4; paced over ``steps``, each
    step takes ceil(backlog / steps), at least 256 (the numbers follow from that rule:
    2048 -> 1024 -> 512 -> 256 -> 256 for 2 steps)."""
    scheduler, runner, _ = workload([4, 4, 4, 4, 1024, 1024], 40, 8, 2048, 16, 4, True, 400,
                                    seed=0, held=2)
    scheduler.prefill_pacing_steps = steps
    for _ in range(2):  # the four short prompts, then their first decode
        batch = scheduler.schedule()
        scheduler.postprocess(batch, runner.run(batch), frozenset())
    assert batch.num_new == [1, 1, 1, 1]
    for seq in runner.held:
        scheduler.add(seq)
    taken = []
    while any(s.num_computed < s.num_prompt_tokens for s in runner.held):
        batch = scheduler.schedule()
        assert batch.num_new[:4] == [1, 1, 1, 1]  # every decode, every step
        taken.append(sum(n for s, n in zip(batch.seqs, batch.num_new, strict=True)
                         if s in runner.held and s.num_computed < s.num_prompt_tokens))
        scheduler.postprocess(batch, runner.run(batch), frozenset())
    assert taken == expected


def test_pacing_reaches_the_scheduler_and_is_checked(tmp_path):
    import argparse

    from llama4_tiny import write_tiny_llama4

    import chunklocal
    from chunklocal.server import cli as serve_cli

    write_tiny_llama4(tmp_path, seed=0)
    llm = chunklocal.LLM(tmp_path, device="cpu", dtype=torch.float32, max_model_len=128,
                         block_size=4, prefill_pacing_steps=3)
    assert llm.scheduler.prefill_pacing_steps == 3
    with pytest.raises(ValueError, match="prefill_pacing_steps must be >= 0.*-1"):
        chunklocal.LLM(tmp_path, device="cpu", prefill_pacing_steps=-1)
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    args = parser.parse_args([str(tmp_path), "--prefill-pacing-steps", "2"])
    assert serve_cli.llm_kwargs(args)["prefill_pacing_steps"] == 2
    with pytest.raises(SystemExit):
        parser.parse_args([str(tmp_path), "--prefill-pacing-steps", "-1"])
