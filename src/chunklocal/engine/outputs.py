"""What the engine hands back per request: vLLM-style ``RequestOutput`` snapshots.

A stream yields cumulative snapshots: each carries every token and all the text so far
(``outputs[i].text`` only grows), and the last one has ``finished=True`` and each
output's ``finish_reason`` ("stop", "length" or "abort").  Times are
``time.monotonic()`` seconds; durations are in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestMetrics:
    arrival_time: float                 # monotonic, when add_request accepted it
    first_token_time: float | None      # first new token of any of its samples
    finished_time: float | None
    #: first_token_time - arrival_time (None before the first token).
    time_to_first_token: float | None
    #: (finished_time - first_token_time) / (tokens - 1) of its longest sample; None
    #: before it finishes or when that sample has a single token.
    time_per_output_token: float | None


@dataclass
class CompletionOutput:
    index: int                          # sample index in [0, n)
    text: str                           # detokenized, stop string cut ("" without tokenizer)
    token_ids: list[int]
    #: Sum of the sampled tokens' logprobs (None unless logprobs were asked for).
    cumulative_logprob: float | None
    #: Per token: {token id: logprob} of the top-k plus the sampled token (raw model
    #: distribution, see engine/sampling.py); None unless asked for.
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None           # None while running; "stop" | "length" | "abort"
    #: The stop string or stop token id that ended it (None for EOS, length, abort).
    stop_reason: int | str | None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    #: Prompt tokens whose KV came from the prefix cache (vLLM's field; OpenAI's
    #: usage.prompt_tokens_details.cached_tokens): sample 0's at its first admission,
    #: None before it is admitted (0 with caching off).
    num_cached_tokens: int | None = None
