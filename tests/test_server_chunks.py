"""Stream chunks are spliced from JSON written once per stream (responses.StreamState):
byte for byte what pydantic writes for the same chunk, for any text (hypothesis: control
characters, quotes, backslashes, non-ASCII), finish and stop reasons, and with usage."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from chunklocal.server.protocol import (
    ChatCompletionChunk,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)
from chunklocal.server.responses import StreamState, choice_json, usage_json

texts = st.text(max_size=40)
reasons = st.sampled_from([None, "stop", "length", "abort", "tool_calls"])
stops = st.one_of(st.none(), st.integers(0, 1 << 40), texts)


def state(chat: bool, rid: str, model: str) -> StreamState:
    return StreamState(chat, rid, model, 1, None, None, False, False)


def pydantic_chunk(chat, st_, choices, usage=None) -> str:
    cls = ChatCompletionChunk if chat else CompletionResponse
    body = cls(id=st_.rid, model=st_.model, choices=choices, usage=usage, created=st_.created)
    return f"data: {body.model_dump_json()}\n\n"


@settings(max_examples=300, deadline=None)
@given(rid=texts, model=texts, index=st.integers(0, 1000), text=texts, reason=reasons,
       stop=stops, tool=st.booleans(), usage=st.booleans())
def test_chunks_equal_pydantics_bytes(rid, model, index, text, reason, stop, tool, usage):
    for chat in (True, False):
        s = state(chat, rid, model)
        u = Usage(prompt_tokens=3, completion_tokens=index, total_tokens=3 + index,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=index // 2)) \
            if usage else None
        spliced = usage_json(3, index, index // 2) if usage else None
        if chat:
            delta = {"content": text} if text else {}
            if tool:
                delta["tool_calls"] = [{"index": 0, "id": "call_1", "type": "function",
                                        "function": {"name": text, "arguments": "{}"}}]
            model_choice = ChatStreamChoice(index=index, delta=delta, finish_reason=reason,
                                            stop_reason=stop)
        else:
            delta = text
            model_choice = CompletionChoice(index=index, text=text, finish_reason=reason,
                                            stop_reason=stop)
        got = s._chunk([choice_json(chat, index, delta, reason, stop)], spliced)
        assert got == pydantic_chunk(chat, s, [model_choice], u)
        two = [model_choice.model_copy(update={"index": i}) for i in (0, 1)]
        assert s._chunk([choice_json(chat, i, delta, reason, stop) for i in (0, 1)],
                        spliced) == \
            pydantic_chunk(chat, s, two, u)


def test_role_and_final_chunks():
    s = state(True, "r", "m")
    role = ChatStreamChoice(index=0, delta={"role": "assistant", "content": ""})
    assert s.role_chunks(1) == [pydantic_chunk(True, s, [role])]
    assert s.final_chunks() == ["data: [DONE]\n\n"]


@settings(max_examples=200, deadline=None)
@given(prompt=st.integers(0, 1 << 40), completion=st.integers(0, 1 << 40),
       cached=st.integers(0, 1 << 40))
def test_usage_json_equals_pydantics(prompt, completion, cached):
    want = Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
    assert usage_json(prompt, completion, cached) == want.model_dump_json()


@settings(max_examples=100, deadline=None)
@given(rid=texts, model=texts)
def test_a_usage_lookalike_in_the_id_or_model_is_not_the_field(rid, model):
    """'"usage":null' inside the id or model is escaped, so the splice finds the field."""
    for text in (rid + '"usage":null', '"usage":null' + model):
        for chat in (True, False):
            s = state(chat, text, text)
            u = Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3,
                      prompt_tokens_details=PromptTokensDetails(cached_tokens=0))
            assert s._chunk([], usage_json(1, 2, 0)) == pydantic_chunk(chat, s, [], u)
