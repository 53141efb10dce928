"""Prompts of a request -> token ids: completions' prompt forms and the chat template.

Chat uses the checkpoint's template through its tokenizer and then tokenizes the rendered
text *without* adding special tokens (the template holds BOS), as transformers'
``apply_chat_template(tokenize=True)`` does: one BOS, never two.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import weakref

from chunklocal.server.params import ServeLimits
from chunklocal.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeChatRequest,
)

# tokenizer -> the most UTF-8 bytes one token can stand for (None: no such bound is known).
_TOKEN_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# apply_chat_template arguments a request sets through its own fields, not chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tokenize", "chat_template",
                             "add_generation_prompt", "continue_final_message", "return_dict",
                             "return_tensors", "padding", "truncation", "max_length", "tools",
                             "documents", "tokenizer_kwargs", "return_assistant_tokens_mask"}


def _no_tokenizer(what: str) -> APIError:
    return APIError(f"{what} needs a tokenizer and this model's directory has none: send token "
                    "ids to /v1/completions", param="prompt" if "prompt" in what else "messages",
                    code="no_tokenizer")


def max_token_bytes(tokenizer) -> int | None:
    """The most bytes of text one token covers, for a byte-level BPE tokenizer without a
    normalizer (Llama-4's kind: every byte of the text is in some token, so a text of B bytes
    has at least B / this many tokens); None for other tokenizers (a normalizer or a
    whitespace pre-tokenizer may drop text)."""
    try:
        return _TOKEN_BYTES[tokenizer]
    except (KeyError, TypeError):
        pass
    longest = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        spec = json.loads(backend.to_str()) if backend is not None else None
        if (spec is not None and spec.get("normalizer") is None
                and "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))
                and "Whitespace" not in json.dumps(spec.get("pre_tokenizer"))):
            longest = max(len(t.encode()) for t in tokenizer.get_vocab())
    except Exception:  # noqa: BLE001 - no bound, no refusal: tokenizing decides
        longest = None
    try:
        _TOKEN_BYTES[tokenizer] = longest
    except TypeError:
        pass
    return longest


def check_fits(text: str, tokenizer, max_model_len: int | None, param: str) -> None:
    """Refuse, before tokenizing it, a text that cannot fit max_model_len with room for one
    new token (a lower bound on its token count from its UTF-8 length)."""
    if max_model_len is None or len(text) < max_model_len:  # a token covers >= 1 character
        return
    longest = max_token_bytes(tokenizer)
    if not longest:
        return
    least = -(-len(text.encode()) // longest)
    if least >= max_model_len:
        raise APIError(f"the text has {len(text.encode())} UTF-8 bytes, so at least {least} "
                       f"tokens (a token covers at most {longest} bytes), which leaves no room "
                       f"for a new token in max_model_len {max_model_len}", param=param,
                       code="context_length_exceeded")


def encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def _check_ids(ids, index: int, vocab_size: int | None, param: str) -> list[int]:
    if not ids:
        raise APIError(f"prompt {index} is empty", param=param)
    if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
        pos, tok = next((p, t) for p, t in enumerate(ids) if not 0 <= t < vocab_size)
        raise APIError(f"prompt {index}: token id {tok} at index {pos} is outside the "
                       f"vocabulary [0, {vocab_size})", param=param)
    return list(ids)


#: Token ids a /v1/completions request may hold and still be checked on the event loop
#: (min and max over them: well under a millisecond) instead of a hop through the pool.
INLINE_IDS = 1 << 14


def ids_only(req) -> bool:
    """A /v1/completions request of token-id prompts only, short enough to check inline."""
    prompt = getattr(req, "prompt", None)
    if not isinstance(prompt, list) or not prompt or isinstance(prompt, str):
        return False
    items = [prompt] if isinstance(prompt[0], int) else prompt
    total = 0
    for item in items:
        if isinstance(item, str):
            return False
        total += len(item)
    return total <= INLINE_IDS


def completion_prompts(req: CompletionRequest, tokenizer, vocab_size: int | None,
                       limits: ServeLimits, max_model_len: int | None = None,
                       ) -> list[tuple[str | None, list[int]]]:
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
            check_fits(item, tokenizer, max_model_len, "prompt")
            ids = encode(tokenizer, item, req.add_special_tokens)
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
    out = {**(msg.model_extra or {}), "role": msg.role, "content": content}
    if out.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(i, out["tool_calls"])
    return out


def _tool_calls(i: int, calls) -> list:
    """An assistant message's ``tool_calls`` for the template, each call's ``arguments`` JSON
    string decoded to an object as vLLM does (templates iterate the arguments)."""
    if not isinstance(calls, list):
        raise APIError(f"messages[{i}].tool_calls must be a list, got {calls!r:.80}",
                       param=f"messages[{i}].tool_calls")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(f"{where} must be {{\"type\": \"function\", \"function\": "
                           f"{{\"name\": ..., \"arguments\": ...}}}}, got {call!r:.80}",
                           param=f"{where}.function")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as err:
                raise APIError(f"{where}.function.arguments is not JSON: {err}, got "
                               f"{fn['arguments']!r:.80}",
                               param=f"{where}.function.arguments") from err
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def chat_prompt(req: ChatCompletionRequest | TokenizeChatRequest, tokenizer,
                vocab_size: int | None, max_model_len: int | None = None,
                default_template: str | None = None,
                tools: list | None = None) -> tuple[str, list[int]]:
    """(rendered text, token ids) of a chat request (or a /tokenize request with messages),
    through the tokenizer's template or the server's --chat-template; ``tools`` (checked
    ones, or None) go to the template as ``tools``."""
    if tokenizer is None:
        raise _no_tokenizer("chat")
    template = req.chat_template or default_template
    if template is None and not getattr(tokenizer, "chat_template", None):
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
            chat_template=template, tools=tools, **extra)
    except Exception as err:  # jinja2 TemplateError, transformers' ValueError, ...
        raise APIError(f"the chat template failed on these messages: "
                       f"{type(err).__name__}: {err}", param="messages") from err
    check_fits(text, tokenizer, max_model_len, "messages")
    ids = encode(tokenizer, text, req.add_special_tokens)
    return text, _check_ids(ids, 0, vocab_size, "messages")


class ClientGone(Exception):
    """The client disconnected before its prompt was tokenized: the work is dropped."""


class TokenizerPool:
    """Tokenization off the event loop: a few threads, each with its own copy of the
    tokenizer (a fast tokenizer must not be used by two threads at once).  Work queued for
    a client that has disconnected is dropped before it runs."""

    def __init__(self, workers: int = 4):
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="chunklocal-tokenize")
        self.local = threading.local()

    def own(self, tokenizer):
        """This thread's copy of ``tokenizer``."""
        if tokenizer is None:
            return None
        held = getattr(self.local, "held", None)
        if held is None or held[0] is not tokenizer:
            held = self.local.held = (tokenizer, copy.deepcopy(tokenizer))
        return held[1]

    async def run(self, request, fn, req, tokenizer, *args):
        """``fn(req, this thread's tokenizer, *args)`` on the pool; ClientGone when the client
        disconnects first (``request``: the Starlette request, its body already read).
        Short token-id prompts need no tokenizer: they are checked here, on the loop (the
        hop to a pool thread and back cost more than the check)."""
        if fn is completion_prompts and ids_only(req):
            return fn(req, tokenizer, *args)
        gone = threading.Event()

        def work():
            if gone.is_set():
                raise ClientGone
            return fn(req, self.own(tokenizer), *args)

        done = asyncio.get_running_loop().run_in_executor(self.pool, work)
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([done, watch], return_when=asyncio.FIRST_COMPLETED)
            if not done.done():
                gone.set()
                done.add_done_callback(lambda f: f.cancelled() or f.exception())
                raise ClientGone
            return done.result()
        finally:
            watch.cancel()


async def _disconnected(request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def prompt_ids(req, tokenizer) -> list[int]:
    """/tokenize with a prompt: its token ids (no length limit, as vLLM's)."""
    if tokenizer is None:
        raise _no_tokenizer("a string prompt")
    return encode(tokenizer, req.prompt, req.add_special_tokens)


def detokenize(req, tokenizer, vocab_size: int | None) -> str:
    """/detokenize: token ids -> text."""
    if tokenizer is None:
        raise APIError("detokenize needs a tokenizer and this model's directory has none",
                       param="tokens", code="no_tokenizer")
    for pos, tok in enumerate(req.tokens):
        if not 0 <= tok < (vocab_size if vocab_size is not None else 1 << 62):
            raise APIError(f"token id {tok} at index {pos} is outside the vocabulary "
                           f"[0, {vocab_size})", param="tokens")
    return tokenizer.decode(req.tokens)
