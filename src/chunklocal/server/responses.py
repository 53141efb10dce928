"""Engine outputs -> OpenAI response bodies and stream chunks.

The engine's outputs are cumulative snapshots (text and token ids so far); a stream sends
each choice's difference from the previous snapshot, so the concatenated deltas equal the
non-streamed text exactly (the engine already holds back partial UTF-8 characters and
partial stop strings).  A chat stream opens each choice with its role and then sends only
chunks with text, except the last one, which carries the finish reason.  With a tool-call
parser (tool_choice "auto"), each choice's text goes through its own parser stream: a delta
holds the content and ``tool_calls`` pieces it released (text that may still become a call
is held back, its logprobs go with the chunk that releases it), and the finish reason is
"tool_calls" when a call was sent and the output stopped by itself.
"""

from __future__ import annotations

import json
import time
from typing import Any

from chunklocal.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from chunklocal.server.tool_choice import finish_reason
from chunklocal.server.tool_parsers import ContentDelta, ToolCallDelta, ToolCallStream, ToolParser


class TokenText:
    """Token id -> the string shown in logprobs (the tokenizer's decoding of that one id)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = (f"token_id:{token_id}" if self.tokenizer is None
                    else self.tokenizer.decode([token_id]))
            self.cache[token_id] = text
        return text


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(tok: TokenText, ids, entries, k: int, offset: int) -> CompletionLogprobs:
    """OpenAI completions logprobs of ``ids`` (``entries[i]``: id -> logprob, holding the
    sampled id and the top k); ``offset``: characters of the choice's text before them."""
    lp = CompletionLogprobs()
    for tid, entry in zip(ids, entries, strict=True):
        text = tok(tid)
        lp.tokens.append(text)
        lp.token_logprobs.append(entry.get(tid))
        lp.top_logprobs.append({tok(t): v for t, v in _top(entry, k)} if k else None)
        lp.text_offset.append(offset)
        offset += len(text)
    return lp


def chat_logprobs(tok: TokenText, ids, entries, k: int) -> ChatLogprobs:
    content = []
    for tid, entry in zip(ids, entries, strict=True):
        text = tok(tid)
        top = [TopLogprob(token=tok(t), logprob=v, bytes=list(tok(t).encode()))
               for t, v in _top(entry, k)]
        content.append(TokenLogprob(token=text, logprob=entry.get(tid, float("-inf")),
                                    bytes=list(text.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


def usage_counts(finals) -> tuple[int, int, int]:
    """(prompt, completion, cached prompt) tokens of the snapshots ``finals``."""
    prompt = completion = cached = 0
    for f in finals:  # one loop: a continuous-usage stream counts on every chunk
        prompt += len(f.prompt_token_ids)
        for o in f.outputs:
            completion += len(o.token_ids)
        # Prompt tokens the prefix cache served (None before a request is admitted: 0).
        cached += getattr(f, "num_cached_tokens", None) or 0
    return prompt, completion, cached


def usage_of(finals) -> Usage:
    prompt, completion, cached = usage_counts(finals)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def usage_json(prompt: int, completion: int, cached: int) -> str:
    """:func:`usage_of`'s JSON as pydantic writes it (Usage's fields in order, compact;
    integers print the same in JSON and Python): a stream with ``continuous_usage_stats``
    sends one per chunk, and building and dumping the models doubled the event loop's CPU
    per chunk (BENCHMARKS.md, stream_chunks; the json encoder took 3 us, this 0.3)."""
    return (f'{{"prompt_tokens":{int(prompt)},"completion_tokens":{int(completion)},'
            f'"total_tokens":{int(prompt) + int(completion)},'
            f'"prompt_tokens_details":{{"cached_tokens":{int(cached)}}}}}')


def completion_response(rid, model, finals, n, tok: TokenText, k) -> CompletionResponse:
    choices = []
    for i, final in enumerate(finals):
        for o in final.outputs:
            lp = (completion_logprobs(tok, o.token_ids, o.logprobs, k, 0)
                  if k is not None else None)
            choices.append(CompletionChoice(index=i * n + o.index, text=o.text, logprobs=lp,
                                            finish_reason=o.finish_reason,
                                            stop_reason=o.stop_reason))
    return CompletionResponse(id=rid, model=model, choices=choices, usage=usage_of(finals))


def _message(o, parser: ToolParser | None, first_call_only: bool):
    """(message, finish reason) of one output; with a parser its calls leave the content."""
    if parser is None:
        return AssistantMessage(content=o.text), o.finish_reason
    content, calls = parser.extract(o.text)
    if first_call_only:
        calls = calls[:1]
    if not calls:
        return AssistantMessage(content=o.text), o.finish_reason
    return (AssistantMessage(content=content, tool_calls=[c.to_openai() for c in calls]),
            finish_reason(calls, o.finish_reason))


def chat_response(rid, model, final, tok: TokenText, k, parser: ToolParser | None = None,
                  first_call_only: bool = False) -> ChatCompletionResponse:
    choices = []
    for o in final.outputs:
        message, reason = _message(o, parser, first_call_only)
        choices.append(ChatChoice(index=o.index, message=message,
                                  logprobs=chat_logprobs(tok, o.token_ids, o.logprobs, k)
                                  if k is not None else None,
                                  finish_reason=reason, stop_reason=o.stop_reason))
    return ChatCompletionResponse(id=rid, model=model, choices=choices, usage=usage_of([final]))


def tool_delta(stream: ToolCallStream, text: str, last: bool, first_call_only: bool,
               ) -> tuple[dict[str, Any], int]:
    """A chat chunk's delta from the parser's events on new ``text`` (and the end of the
    output when ``last``), and the number of calls it opens."""
    events = stream.feed(text) if text else []
    if last:
        events += stream.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [e for e in events if isinstance(e, ToolCallDelta)
             and not (first_call_only and e.index > 0)]
    delta: dict[str, Any] = {"content": content} if content else {}
    if calls:
        delta["tool_calls"] = [e.to_openai() for e in calls]
    return delta, sum(e.id is not None for e in calls)


def choice_json(chat: bool, index: int, delta, finish_reason=None, stop_reason=None) -> str:
    """A stream choice without logprobs as pydantic writes it (ChatStreamChoice's or
    CompletionChoice's fields in their order, compact, UTF-8 unescaped), by the json
    module's C encoder, without building models (tests/test_server_chunks.py holds the bytes
    equal; the cost per chunk is in BENCHMARKS.md)."""
    return _encode({"index": index, "delta" if chat else "text": delta, "logprobs": None,
                    "finish_reason": finish_reason, "stop_reason": stop_reason})


_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class StreamState:
    """Per-choice progress of a stream: characters and tokens already sent."""

    def __init__(self, chat: bool, rid: str, model: str, n: int, tok: TokenText, k,
                 include_usage: bool, continuous_usage: bool,
                 parser: ToolParser | None = None, first_call_only: bool = False):
        self.chat, self.rid, self.model, self.n, self.tok, self.k = chat, rid, model, n, tok, k
        self.include_usage, self.continuous_usage = include_usage, continuous_usage
        self.parser, self.first_call_only = parser, first_call_only
        self.tool_streams: dict[int, ToolCallStream] = {}  # choice index -> its parse
        self.calls: dict[int, int] = {}  # choice index -> tool calls sent
        self.sent_chars: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}
        self.done: set[int] = set()
        self.latest: dict[int, object] = {}  # prompt index -> latest snapshot (for usage)
        # Every chunk of a stream has the same id, created and model (OpenAI's): the
        # envelope is serialised once, and each chunk splices its choices into it.
        self.created = int(time.time())
        cls = ChatCompletionChunk if chat else CompletionResponse
        body = cls(id=rid, model=model, choices=[], usage=None,
                   created=self.created).model_dump_json()
        head, mark, rest = body.rpartition('"choices":[]')
        self._head, self._tail = f"data: {head}{mark[:-1]}", f"]{rest}\n\n"
        # where a usage goes (a JSON string cannot hold '"usage":null' unescaped: the
        # match is the field)
        before, null, after = self._head.partition('"usage":null')
        if not null or '"usage":null' in after:
            raise AssertionError(f"no single usage field in {self._head!r}")
        self._usage_at = (before + '"usage":', after)

    def _chunk(self, choices: list[str], usage: str | None = None) -> str:
        """A chunk of ``choices`` (each one's JSON: :func:`choice_json`) with ``usage``
        (:func:`usage_json`; None: ``"usage":null``)."""
        if usage is None:
            return self._head + ",".join(choices) + self._tail
        before, after = self._usage_at
        return before + usage + after + ",".join(choices) + self._tail

    def role_chunks(self, num_choices: int) -> list[str]:
        """Chat streams open each choice with the assistant role, as OpenAI's do."""
        return [self._chunk([choice_json(True, i, {"role": "assistant", "content": ""})])
                for i in range(num_choices)]

    def update(self, prompt_index: int, out) -> list[str]:
        """The chunks a new snapshot of prompt ``prompt_index`` adds."""
        self.latest[prompt_index] = out
        chunks = []
        for o in out.outputs:
            index = prompt_index * self.n + o.index
            if index in self.done:
                continue
            chars, ntok = self.sent_chars.get(index, 0), self.sent_tokens.get(index, 0)
            delta, new_ids = o.text[chars:], o.token_ids[ntok:]
            reason = o.finish_reason
            chat_delta: dict[str, Any] = {"content": delta} if delta else {}
            if self.chat and self.parser is not None:
                stream = self.tool_streams.get(index)
                if stream is None:
                    stream = self.tool_streams[index] = self.parser.new_stream()
                chat_delta, opened = tool_delta(stream, delta, reason is not None,
                                                self.first_call_only)
                self.sent_chars[index] = len(o.text)  # fed to the parser: never again
                self.calls[index] = self.calls.get(index, 0) + opened
                reason = finish_reason(self.calls[index], reason)
            if not chat_delta and o.finish_reason is None and (self.chat or not new_ids):
                # No text yet (a held-back partial character or stop string): a chat chunk
                # would have an empty delta; its tokens' logprobs go with the next chunk.
                continue
            entries = o.logprobs[ntok:len(o.token_ids)] if self.k is not None and new_ids \
                else None
            if entries is None:
                choice = choice_json(self.chat, index, chat_delta if self.chat else delta,
                                     reason if self.chat else o.finish_reason, o.stop_reason)
            elif self.chat:  # pydantic serialises the logprobs' models
                choice = ChatStreamChoice(
                    index=index, delta=chat_delta,
                    logprobs=chat_logprobs(self.tok, new_ids, entries, self.k),
                    finish_reason=reason, stop_reason=o.stop_reason).model_dump_json()
            else:
                choice = CompletionChoice(
                    index=index, text=delta,
                    logprobs=completion_logprobs(self.tok, new_ids, entries, self.k, chars),
                    finish_reason=o.finish_reason, stop_reason=o.stop_reason).model_dump_json()
            self.sent_chars[index], self.sent_tokens[index] = len(o.text), len(o.token_ids)
            if o.finish_reason is not None:
                self.done.add(index)
            usage = usage_json(*usage_counts(self.latest.values())) \
                if self.continuous_usage else None
            chunks.append(self._chunk([choice], usage))
        return chunks

    def final_chunks(self) -> list[str]:
        chunks = []
        if self.include_usage:
            chunks.append(self._chunk([], usage_json(*usage_counts(self.latest.values()))))
        chunks.append("data: [DONE]\n\n")
        return chunks
