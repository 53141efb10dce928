"""OpenAI-compatible request and response bodies (pydantic), plus the error type.

Requests are parsed in strict mode from the raw JSON: ``max_tokens: 2.5``, ``"n": true`` or
``"seed": "1"`` are 400s, not silently coerced.  Unknown fields are accepted and ignored with
a warning naming them, as vLLM's ``OpenAIBaseModel`` does (``params.check_fields``); OpenAI
and vLLM fields this server does not serve are declared here so that their neutral values
(``null``, ``false``, ``[]``...) pass and other values are refused by name.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class APIError(Exception):
    """An HTTP error answered with OpenAI's error JSON; the server keeps serving."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.type = type or {401: "authentication_error", 404: "not_found_error",
                             503: "service_unavailable"}.get(
                                 status, "invalid_request_error" if status < 500
                                 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class _Request(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        """``"n": null``, ``"stream": null``...: OpenAI's clients send null for unset
        fields, so a null means the field's default (as OpenAI and vLLM read it)."""
        if isinstance(data, dict):
            fields = cls.model_fields
            data = {k: v for k, v in data.items()
                    if v is not None or k not in fields or fields[k].default is None}
        return data

    model: str | None = None  # vLLM: optional, defaults to the served model
    # OpenAI sampling fields (None = unset: the checkpoint's generation_config decides).
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # Not served: accepted only at the neutral value listed in params.NOT_SERVED.
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    min_tokens: int | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    spaces_between_special_tokens: bool | None = None
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    priority: int | None = None
    echo: bool | None = None


class CompletionRequest(_Request):
    # str | list[str] | list[int] | list[list[int]]: one prompt or a batch of prompts.
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    add_special_tokens: bool = True  # vLLM: BOS etc. when tokenizing a string prompt
    suffix: str | None = None  # not served


class ChatMessage(BaseModel):
    # Other keys (name, tool_call_id, ...) go to the chat template as they are.
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    # vLLM chat fields: the template is applied by the tokenizer, as transformers does.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template already holds BOS: no second one
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Tools: checked by tool_choice.tool_policy (the server's --enable-auto-tool-choice).
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # False: only the first parsed call is kept
    # Not served (neutral values pass).
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    reasoning_effort: str | None = None
    web_search_options: Any = None
    documents: list[Any] | None = None


class TokenizeCompletionRequest(BaseModel):
    """vLLM's /tokenize body with a prompt."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    """vLLM's /tokenize body with messages (rendered by the chat template)."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    tokens: list[int]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


# -- responses -------------------------------------------------------------------------------
FinishReason = Literal["stop", "length", "abort", "tool_calls"] | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens read from the prefix cache, not computed


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token id that ended it


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    usage: Usage | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class ChatStreamChoice(BaseModel):
    index: int
    # {"role": "assistant", "content": ""} first, then {"content": "..."} and / or
    # {"tool_calls": [...]}; {} only with the finish reason.
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "chunklocal"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
