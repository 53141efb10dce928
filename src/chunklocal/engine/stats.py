"""``GenerateStats``: what one ``LLM.generate`` / ``prompt_logits`` call did.

Per call, also with several threads calling at once: token and request counts,
preemptions and drafts are of the call's own requests; ``steps`` counts the engine
steps from the first to the last that ran one of them, and the peaks (virtual batches
per step, KV blocks) are over those steps, which other calls' requests may share.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerateStats:
    requests: int
    prompt_tokens: int
    new_tokens: int
    steps: int
    seconds: float
    peak_virtual_batches: int
    preemptions: int
    draft_tokens: int
    accepted_tokens: int
    peak_blocks: dict
    virtual_batches_per_step: list = field(default_factory=list)
    tokens_per_step: list = field(default_factory=list)

    def summary(self) -> str:
        tps = (self.prompt_tokens + self.new_tokens) / max(self.seconds, 1e-9)
        return (f"{self.requests} requests, {self.prompt_tokens} prompt + {self.new_tokens} new "
                f"tokens in {self.seconds:.2f} s ({tps:.0f} tokens/s, "
                f"{self.new_tokens / max(self.seconds, 1e-9):.1f} new tokens/s), {self.steps} "
                f"steps, peak virtual batches per step {self.peak_virtual_batches}, "
                f"preemptions {self.preemptions}, drafts accepted {self.accepted_tokens}/"
                f"{self.draft_tokens}, peak KV blocks {self.peak_blocks}")


def call_stats(core, requests, seconds: float) -> GenerateStats:
    """Statistics of one call's (finished) requests."""
    seqs = [s for r in requests for s in r.seqs]
    firsts = [r.first_step for r in requests if r.first_step is not None]
    log = core.step_log
    steps, picked = 0, []
    if firsts:
        first, last = min(firsts), max(r.last_step for r in requests if r.last_step)
        steps = last - first + 1
        oldest = core.num_steps - len(log) + 1  # step number of log[0]
        picked = [log[i - oldest] for i in range(max(first, oldest), last + 1)]
    names = core.llm.group_names
    peak_blocks = {name: max((entry[2][g] for entry in picked), default=0)
                   for g, name in enumerate(names)}
    return GenerateStats(
        len(requests), sum(len(r.prompt_token_ids) for r in requests),
        sum(len(s.token_ids) for r in requests for s in r.samples), steps, seconds,
        max((entry[0] for entry in picked), default=0),
        sum(s.num_preemptions for s in seqs), sum(s.num_draft_tokens for s in seqs),
        sum(s.num_accepted for s in seqs), peak_blocks,
        [entry[0] for entry in picked], [entry[1] for entry in picked])
