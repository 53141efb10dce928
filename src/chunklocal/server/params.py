"""Request body -> engine sampling arguments, with the server's limits.

Every refusal is an ``APIError`` (HTTP 400) naming the field and the value, raised before
anything reaches the engine, so a refused request changes no state.
"""

from __future__ import annotations

import logging

from chunklocal.server.limits import ServeLimits
from chunklocal.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    _Request,
)
from chunklocal.server.tool_choice import ToolPolicy, ToolRequestError, tool_policy

__all__ = ["ServeLimits", "check_fields", "check_limits", "sampling_kwargs", "tools_of"]

log = logging.getLogger("chunklocal.server")


# Request fields handed to SamplingParams unchanged when the client set them (vLLM names).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty",
                   "include_stop_str_in_output", "skip_special_tokens")

# OpenAI / vLLM fields this server does not serve: accepted only at these neutral values.
NOT_SERVED = {
    "logit_bias": (None, {}), "min_tokens": (None, 0), "use_beam_search": (None, False),
    "length_penalty": (None, 1.0), "prompt_logprobs": (None,), "truncate_prompt_tokens": (None,),
    "spaces_between_special_tokens": (None, True),
    "response_format": (None, {"type": "text"}), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "priority": (None, 0), "echo": (None, False), "suffix": (None, ""), "functions": (None, []),
    "function_call": (None, "none", "auto"), "audio": (None,), "prediction": (None,),
    "modalities": (None, ["text"]), "service_tier": (None, "auto", "default"),
    "store": (None, False), "reasoning_effort": (None,), "web_search_options": (None,),
    "documents": (None, []),
}


def _same(a, b) -> bool:
    # True == 1 == 1.0 in Python; a neutral value must also match in type.
    return a == b and (a is None) == (b is None) and isinstance(a, bool) == isinstance(b, bool)


def warn_extra(req) -> None:
    """Unknown fields are ignored with a warning naming them, as vLLM's OpenAIBaseModel
    does (OpenAI's API accepts extra fields; clients send their own)."""
    extra = set(req.model_extra or ())
    opts = getattr(req, "stream_options", None)
    if opts is not None and opts.model_extra:
        extra |= {f"stream_options.{k}" for k in opts.model_extra}
    if extra:
        log.warning("The following fields were present in the request but ignored: %s",
                    sorted(extra))


def check_fields(req: _Request) -> None:
    """Refuse fields we do not serve at non-neutral values (unknown fields: warn_extra)."""
    for name, neutral in NOT_SERVED.items():
        if name not in req.model_fields_set:
            continue
        value = getattr(req, name)
        if not any(_same(value, v) for v in neutral):
            raise APIError(f"{name}={value!r} is not served by this server (accepted only as "
                           f"{' or '.join(repr(v) for v in neutral)})", param=name,
                           code="unsupported_field")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(f"best_of={req.best_of!r} is not served by this server (only best_of = n "
                       f"= {req.n})", param="best_of", code="unsupported_field")


def tools_of(req: ChatCompletionRequest, auto_tool_choice: bool,
             tool_call_parser: str | None) -> ToolPolicy:
    """The request's ``tools`` / ``tool_choice`` checked against the server's
    --enable-auto-tool-choice / --tool-call-parser (tool_choice.tool_policy), as a 400 naming
    the field path (``tools[0].function.name``, ``tool_choice``...)."""
    try:
        return tool_policy(req.tools, req.tool_choice, auto_tool_choice=auto_tool_choice,
                           tool_call_parser=tool_call_parser)
    except ToolRequestError as err:
        raise APIError(str(err), param=err.param) from err


def check_limits(req: CompletionRequest | ChatCompletionRequest,
                 limits: ServeLimits) -> int | None:
    """Check n, stop and logprobs against the limits; return the requested top-k logprobs."""
    if not 1 <= req.n <= limits.max_n:
        raise APIError(f"n must be between 1 and {limits.max_n} (--max-n), got {req.n}",
                       param="n")
    if req.stream_options is not None and not req.stream:
        raise APIError("stream_options is only allowed with stream: true",
                       param="stream_options")
    if req.seed is not None and not 0 <= req.seed <= 2**63 - req.n:
        # Sample i of n uses seed + i: every one must be a valid seed, in [0, 2**63).
        raise APIError(f"seed must be in [0, 2**63 - n] = [0, {2**63 - req.n}] with n = "
                       f"{req.n} (sample i uses seed + i), got {req.seed}", param="seed")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > limits.max_stop:
        raise APIError(f"{len(stops)} stop strings exceed the limit of {limits.max_stop} "
                       "(--max-stop)", param="stop")
    for s in stops:
        if not s or len(s) > limits.max_stop_chars:
            raise APIError(f"each stop string must have 1 to {limits.max_stop_chars} "
                           f"characters, got {s!r:.80}", param="stop")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > limits.max_stop:
        raise APIError(f"{len(req.stop_token_ids)} stop_token_ids exceed the limit of "
                       f"{limits.max_stop} (--max-stop)", param="stop_token_ids")
    if isinstance(req, ChatCompletionRequest):
        if req.chat_template is not None and not limits.trust_request_chat_template:
            raise APIError("a chat_template in the request is used only when the server runs "
                           "with --trust-request-chat-template", param="chat_template")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        top = (req.top_logprobs or 0) if req.logprobs else None
        param = "top_logprobs"
    else:
        top, param = req.logprobs, "logprobs"
    if top is not None and not 0 <= top <= limits.max_logprobs:
        raise APIError(f"{param} must be between 0 and {limits.max_logprobs} (--max-logprobs), "
                       f"got {top}", param=param)
    return top


def max_tokens_of(req: _Request) -> tuple[int | None, str]:
    """The requested max new tokens, and the field the client set it with."""
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        if req.max_tokens is not None and req.max_tokens != req.max_completion_tokens:
            raise APIError(f"max_tokens={req.max_tokens} and max_completion_tokens="
                           f"{req.max_completion_tokens} disagree", param="max_tokens")
        return req.max_completion_tokens, "max_completion_tokens"
    return req.max_tokens, "max_tokens"


def sampling_kwargs(req: _Request, top_logprobs: int | None, prompt_len: int,
                    max_model_len: int, default_max_tokens: int | None = None) -> dict:
    """SamplingParams keyword arguments for one prompt: only the fields the client set
    (the engine fills the rest from the checkpoint's generation_config), and max_tokens
    defaulting, as vLLM's does, to the room left in max_model_len, or to the
    generation_config's max_new_tokens (``default_max_tokens``) when that is smaller."""
    room = max_model_len - prompt_len
    prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    if room < 1:
        raise APIError(f"the prompt has {prompt_len} tokens, which leaves no room for a new "
                       f"token in max_model_len {max_model_len}", param=prompt_param,
                       code="context_length_exceeded")
    max_tokens, name = max_tokens_of(req)
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(room, default_max_tokens)
    elif max_tokens < 1:
        raise APIError(f"{name} must be at least 1, got {max_tokens}", param=name)
    elif max_tokens > room:
        raise APIError(f"{name} {max_tokens} + the prompt's {prompt_len} tokens exceed "
                       f"max_model_len {max_model_len} (at most {room} new tokens)",
                       param=name, code="context_length_exceeded")
    kwargs = {name: getattr(req, name) for name in SAMPLING_FIELDS
              if name in req.model_fields_set and getattr(req, name) is not None}
    kwargs.update(n=req.n, max_tokens=max_tokens)
    if top_logprobs is not None:
        kwargs["logprobs"] = top_logprobs
    return kwargs
