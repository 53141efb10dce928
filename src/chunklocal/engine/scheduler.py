"""Continuous batching: which requests run this step, with how many tokens.

Per step, under ``max_num_seqs`` running requests and ``max_num_batched_tokens``
query tokens: decodes first (each with its prompt-lookup draft, if speculative
decoding is on), then prefills already under way, then new admissions.  A
prefill longer than the remaining budget is split anywhere, also mid-chunk.
With ``prefill_pacing_steps`` H > 0, a step that carries decodes takes at most
``max(ceil(backlog / H), PACING_MIN_TOKENS)`` prompt tokens, the backlog being every prompt
token not yet computed (running prefills and waiting requests).  Prompts that arrive
together (clients of one cohort, finishing in the same step) then spread over several
steps instead of alternating full and decode-only steps, so the decodes' inter-token gaps
stay even; the backlog still drains (each step takes at least 1/H of it).

Admission first looks the request's prompt up in the prefix cache (engine/prefix_cache.py)
and computes only what is not cached.  Admission waits while pages are short; a
running request that cannot get pages preempts the most recently admitted unscheduled
request (its KV is dropped and recomputed later, its tokens are kept), so nothing is
ever lost.

Progress is checked, so a pool that cannot serve its requests fails instead of
looping: ``schedule()`` raises RuntimeError when it can schedule nothing while
requests wait, or when more steps than there are tokens left to compute (prompt
plus new tokens of every unfinished request, doubled) pass without one new token.
Every step computes at least one token, so only requests that keep losing their
KV to preemption can get there.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from chunklocal.engine.block_manager import BlockManager
from chunklocal.engine.sequence import Sequence, Status

#: Prompt tokens a paced step may always take, however small the backlog: a short
#: prompt is not cut into slivers, and its cost beside the decodes stays small.
PACING_MIN_TOKENS = 256


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)        # query tokens per request
    drafts: list[list[int]] = field(default_factory=list)   # speculative tokens per request
    #: ``seq_id`` of every request in ``seqs`` (constant-time "already scheduled?").
    scheduled_ids: set[int] = field(default_factory=set)

    def add(self, seq, num_new, draft=()):
        self.seqs.append(seq)
        self.scheduled_ids.add(seq.seq_id)
        self.num_new.append(num_new)
        self.drafts.append(list(draft))

    def add_decodes(self, seqs):
        """One token each, no drafts (the request-by-request ``add`` of each, at once)."""
        self.seqs.extend(seqs)
        self.scheduled_ids.update(s.seq_id for s in seqs)
        self.num_new.extend([1] * len(seqs))
        self.drafts.extend([] for _ in seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)


def propose_ngram(tokens: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier match of the last n-gram."""
    if k <= 0 or len(tokens) < 2:
        return []
    arr = np.asarray(tokens)
    for n in range(min(max_ngram, len(arr) - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int,
                 num_speculative_tokens: int = 0, pad_drafts: bool = False,
                 long_prefill_token_threshold: int = 0, prefill_pacing_steps: int = 0):
        self.block_manager = block_manager
        #: Prompt tokens one request may prefill per step (vLLM's
        #: ``long_prefill_token_threshold``; 0: the step's whole budget).  A lower cap shares
        #: each step between several prefills and the running decodes, so a long prompt
        #: stretches the decodes' steps less (their inter-token latency), at the cost of its
        #: own time to first token.
        self.prefill_cap = long_prefill_token_threshold or max_num_batched_tokens
        #: Steps a step with decodes spreads the prompt backlog over (0: no pacing).
        self.prefill_pacing_steps = prefill_pacing_steps
        self.pacing_min_tokens = PACING_MIN_TOKENS
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        #: Pad every draft to its full length (CUDA-graph verify needs equal windows).
        #: A filler token is accepted only when it is the greedy token anyway.
        self.pad_drafts = pad_drafts
        self.waiting: deque[Sequence] = deque()
        #: Tokens the waiting requests will prefill (their whole ``token_ids``: a waiting
        #: request has no KV), kept as requests come and go instead of summed per step.
        self.waiting_tokens = 0
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_draft_tokens = 0
        self.num_accepted = 0
        #: Prompt + new tokens of the unfinished requests, and steps since a new token.
        self.tokens_left = 0
        self.steps_without_token = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.waiting_tokens += len(seq.token_ids)
        self.tokens_left += seq.num_prompt_tokens + seq.max_tokens

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_all(self) -> list[Sequence]:
        """Drop every unfinished request and give back its pages (after a failed step).

        Returns the dropped requests.  Leaves the scheduler and block manager as
        if none of them had been added, so the next call starts clean.
        """
        dropped = [*self.running, *self.waiting]
        for seq in dropped:
            self.block_manager.free(seq)
            seq.num_computed = 0
            seq.status = Status.FINISHED
        self.running.clear()
        self.waiting.clear()
        self.block_manager.reset_cache()  # the failed step's KV may be half written
        self.tokens_left = self.steps_without_token = self.waiting_tokens = 0
        return dropped

    def abort(self, seq: Sequence) -> bool:
        """Drop one unfinished request and give back its pages now; False if not here."""
        if seq.status is Status.FINISHED:
            return False
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
            self.waiting_tokens -= len(seq.token_ids)
        self.block_manager.free(seq)
        seq.status = Status.FINISHED
        self.tokens_left -= seq.num_prompt_tokens + seq.max_tokens
        return True

    def _draft(self, seq: Sequence) -> list[int]:
        if not seq.params.plain_greedy:
            return []  # drafts are verified by the argmax of the raw logits
        k = min(self.num_speculative_tokens, seq.remaining_new_tokens - 1,
                self.max_model_len - len(seq))
        draft = propose_ngram(seq.token_ids, k)
        if self.pad_drafts and 0 < k:
            draft += [draft[-1] if draft else seq.token_ids[-1]] * (k - len(draft))
        return draft

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.waiting_tokens += len(seq.token_ids)

    def _fit(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> bool:
        """Get pages for ``seq``, preempting unscheduled later requests; False if it yields."""
        while not self.block_manager.can_allocate(seq, num_new):
            # The most recently admitted running request not yet scheduled this step.
            victim = next((s for s in reversed(self.running)
                           if s is not seq and s.seq_id not in batch.scheduled_ids), None)
            self._preempt(seq if victim is None else victim)
            if victim is None:
                return False
        self.block_manager.allocate(seq, num_new)
        return True

    def _decodes_at_once(self, decodes, batch: ScheduledBatch, budget: int) -> bool:
        """Schedule every plain decode in one vectorised pass (the common step of a busy
        server); False, with nothing changed, where the request-by-request loop must decide
        (drafts, a token budget smaller than the decodes, pages short)."""
        if self.num_speculative_tokens or not decodes or len(decodes) > budget:
            return False
        changes = self.block_manager.decode_changes(decodes)
        if changes is None:
            return False
        for i in changes.tolist():
            self.block_manager.allocate(decodes[i], 1)
        batch.add_decodes(decodes)
        return True

    def _prefill_room(self, num_decodes: int, prefills: list[Sequence], budget: int) -> int:
        """Prompt tokens this step may take: the whole budget, or the paced share of the
        backlog when decodes run beside it (module docstring)."""
        steps = self.prefill_pacing_steps
        if not steps or not num_decodes:
            return budget
        backlog = self.waiting_tokens + sum(s.num_uncomputed for s in prefills)
        return min(budget, max(-(-backlog // steps), self.pacing_min_tokens))

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        decodes = [s for s in self.running if len(s.token_ids) - s.num_computed <= 1]
        prefills = [s for s in self.running if len(s.token_ids) - s.num_computed > 1]
        room = self._prefill_room(len(decodes), prefills, budget - len(decodes))
        if self._decodes_at_once(decodes, batch, budget):
            budget -= len(decodes)
            decodes = []
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted by an earlier request this step
                continue
            if seq.is_prefilling:
                if room == 0:
                    break  # prefills come after every decode
                draft, num_new = [], min(seq.num_uncomputed, budget, self.prefill_cap, room)
            else:
                draft = self._draft(seq)[:budget - 1]
                num_new = 1 + len(draft)
            if self._fit(seq, num_new, batch):
                batch.add(seq, num_new, draft)
                budget -= num_new
                room -= num_new if seq.is_prefilling else 0
        budget = min(budget, room)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            with self.block_manager.lock:  # a hit's pages stay cached until allocated
                hit = self.block_manager.lookup(seq)  # prefix cache: None when off or no hit
                num_new = min(seq.num_uncomputed - (0 if hit is None else hit.num_tokens),
                              budget, self.prefill_cap)
                if not self.block_manager.can_allocate(seq, num_new, hit):
                    break  # admission waits for pages
                self.block_manager.allocate(seq, num_new, hit)
            self.waiting.popleft()
            self.waiting_tokens -= len(seq.token_ids)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget -= num_new
        self._check_progress(batch)
        return batch

    def _check_progress(self, batch: ScheduledBatch) -> None:
        self.steps_without_token += 1
        if batch.seqs and self.steps_without_token <= 2 * self.tokens_left:
            return
        free = [grp.num_free for grp in self.block_manager.groups]
        state = (f"{len(self.waiting)} waiting, {len(self.running)} running, "
                 f"{self.num_preemptions} preemptions so far, free KV blocks per group {free}")
        if not batch.seqs:
            raise RuntimeError(f"no request can be scheduled ({state}): the KV pool cannot "
                               "hold the next request's pages")
        raise RuntimeError(f"no new token in {self.steps_without_token - 1} steps ({state}): "
                           "requests keep losing their KV to preemption; the KV pool is too "
                           "small for them")

    def _append(self, seq: Sequence, new: list[int], eos_ids: frozenset[int]) -> bool:
        """Append ``new`` up to the first that finishes ``seq``; True if one did."""
        params, ids = seq.params, seq.token_ids
        end = min(seq.num_prompt_tokens + seq.max_tokens, self.max_model_len)
        for token in new:
            ids.append(token)
            if token in eos_ids and not params.ignore_eos:
                seq.finish_reason = "stop"
            elif token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
            elif len(ids) >= end:
                seq.finish_reason = "length"
            else:
                continue
            seq.status = Status.FINISHED
            return True
        return False

    def postprocess(self, batch: ScheduledBatch, sampled: list[np.ndarray],
                    eos_ids: frozenset[int]) -> list[Sequence]:
        """Advance each request by its step's result; return the ones that finished.

        ``sampled[i]`` holds the tokens chosen at request ``i``'s logit rows:
        none for a prefill piece that does not reach the end, one after the
        last prompt token or a plain decode, ``len(draft) + 1`` for a verify.
        """
        finished = []
        # One conversion for the whole step (not one numpy scalar per token).
        flat = np.concatenate(sampled).tolist() if sampled else []
        at = 0
        for seq, num_new, draft, tokens in zip(batch.seqs, batch.num_new, batch.drafts, sampled,
                                               strict=True):
            count = len(tokens)
            if count == 0:
                seq.num_computed += num_new
                continue
            new = flat[at:at + count]
            at += count
            if draft:  # verify: the draft's accepted prefix, then the first correction
                accepted = 0
                while accepted < len(draft) and draft[accepted] == new[accepted]:
                    accepted += 1
                self.num_draft_tokens += len(draft)
                self.num_accepted += accepted
                seq.num_draft_tokens += len(draft)
                seq.num_accepted += accepted
                num_new -= len(draft) - accepted
                new = new[:accepted + 1]
            seq.num_computed += num_new
            self.steps_without_token = 0
            if self._append(seq, new, eos_ids):
                self.block_manager.free(seq)
                self.tokens_left -= seq.num_prompt_tokens + seq.max_tokens
                finished.append(seq)
        if finished:  # one pass, order kept (not one list.remove per finished request)
            self.running = [s for s in self.running if s.status is not Status.FINISHED]
        return finished
