"""The server's per-request limits (no web imports: the CLI reads the defaults)."""

from __future__ import annotations

from dataclasses import dataclass

MIN_BODY_BYTES = 4 << 20


@dataclass(frozen=True)
class ServeLimits:
    """Per-request limits that bound the memory one request can make the server use."""

    #: Request body (JSON) size; None: room for a max_model_len prompt (body_limit).
    max_request_bytes: int | None = None
    max_n: int = 16                    # completions per prompt
    max_logprobs: int = 20             # top logprobs per token (vLLM's --max-logprobs)
    max_stop: int = 16                 # stop strings (and, separately, stop token ids)
    max_stop_chars: int = 256          # length of one stop string
    max_prompts: int = 64              # prompts in one /v1/completions batch
    #: A request's own ``chat_template`` runs on the server's tokenizer thread, unbounded:
    #: only with --trust-request-chat-template (vLLM's flag).
    trust_request_chat_template: bool = False

    def body_limit(self, max_model_len: int | None) -> int:
        """Bytes a request body may have: the explicit limit, else 16 bytes per token of
        max_model_len (a token id in JSON takes at most 8, text about 4 per token) and
        at least 4 MiB."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return max(MIN_BODY_BYTES, 16 * (max_model_len or 0))
