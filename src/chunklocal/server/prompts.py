"""Prompts of a request -> token ids: completions' prompt forms and the chat template.

Chat uses the checkpoint's template through its tokenizer and then tokenizes the rendered
text *without* adding special tokens (the template holds BOS), as transformers'
``apply_chat_template(tokenize=True)`` does: one BOS, never two.
"""

from __future__ import annotations

from chunklocal.server.params import ServeLimits
from chunklocal.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

# apply_chat_template arguments a request sets through its own fields, not chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tokenize", "chat_template",
                             "add_generation_prompt", "continue_final_message", "return_dict",
                             "return_tensors", "padding", "truncation", "max_length", "tools",
                             "documents", "tokenizer_kwargs", "return_assistant_tokens_mask"}


def _no_tokenizer(what: str) -> APIError:
    return APIError(f"{what} needs a tokenizer and this model's directory has none: send token "
                    "ids to /v1/completions", param="prompt" if "prompt" in what else "messages",
                    code="no_tokenizer")


def _check_ids(ids, index: int, vocab_size: int | None, param: str) -> list[int]:
    if not ids:
        raise APIError(f"prompt {index} is empty", param=param)
    if vocab_size is not None:
        for pos, tok in enumerate(ids):
            if not 0 <= tok < vocab_size:
                raise APIError(f"prompt {index}: token id {tok} at index {pos} is outside the "
                               f"vocabulary [0, {vocab_size})", param=param)
    return list(ids)


def completion_prompts(req: CompletionRequest, tokenizer, vocab_size: int | None,
                       limits: ServeLimits) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt of a /v1/completions request."""
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise APIError("prompt is empty", param="prompt")
    if len(items) > limits.max_prompts:
        raise APIError(f"{len(items)} prompts in one request exceed the limit of "
                       f"{limits.max_prompts} (--max-prompts)", param="prompt")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if tokenizer is None:
                raise _no_tokenizer("a string prompt")
            if not item:
                raise APIError(f"prompt {i} is empty", param="prompt")
            ids = tokenizer(item, add_special_tokens=req.add_special_tokens)["input_ids"]
            out.append((item, _check_ids(ids, i, vocab_size, "prompt")))
        else:
            out.append((None, _check_ids(item, i, vocab_size, "prompt")))
    return out


def _message(i: int, msg) -> dict:
    content = msg.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.get("type") != "text":
                raise APIError(f"messages[{i}].content[{j}]: only text parts are served, got "
                               f"type {part.get('type')!r}", param=f"messages[{i}].content")
            if not isinstance(part.get("text"), str):
                raise APIError(f"messages[{i}].content[{j}]: a text part needs a string "
                               f"'text', got {part.get('text')!r:.80}",
                               param=f"messages[{i}].content")
            texts.append(part["text"])
        content = "\n".join(texts)
    return {**(msg.model_extra or {}), "role": msg.role, "content": content}


def chat_prompt(req: ChatCompletionRequest, tokenizer,
                vocab_size: int | None) -> tuple[str, list[int]]:
    """(rendered text, token ids) of a chat request, through the tokenizer's template."""
    if tokenizer is None:
        raise _no_tokenizer("chat")
    if req.chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError("this model's tokenizer has no chat template: use /v1/completions, or "
                       "pass chat_template in the request (with a server run with "
                       "--trust-request-chat-template)", param="messages",
                       code="no_chat_template")
    extra = dict(req.chat_template_kwargs or {})
    clash = sorted(_RESERVED_TEMPLATE_KWARGS & extra.keys())
    if clash:
        raise APIError(f"chat_template_kwargs may not set {clash[0]!r}",
                       param="chat_template_kwargs")
    messages = [_message(i, m) for i, m in enumerate(req.messages)]
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template=req.chat_template, **extra)
    except Exception as err:  # jinja2 TemplateError, transformers' ValueError, ...
        raise APIError(f"the chat template failed on these messages: "
                       f"{type(err).__name__}: {err}", param="messages") from err
    ids = tokenizer(text, add_special_tokens=req.add_special_tokens)["input_ids"]
    return text, _check_ids(ids, 0, vocab_size, "messages")
