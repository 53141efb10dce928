"""The server's per-request limits (no web imports: the CLI reads the defaults)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServeLimits:
    """Per-request limits that bound the memory one request can make the server use."""

    max_request_bytes: int = 4 << 20   # request body (JSON) size
    max_n: int = 16                    # completions per prompt
    max_logprobs: int = 20             # top logprobs per token (vLLM's --max-logprobs)
    max_stop: int = 16                 # stop strings (and, separately, stop token ids)
    max_stop_chars: int = 256          # length of one stop string
    max_prompts: int = 64              # prompts in one /v1/completions batch
