"""``tools`` / ``tool_choice`` in chat completions, as ``vllm serve --enable-auto-tool-choice
--tool-call-parser llama4_pythonic`` serves them, through the official ``openai`` client.

The stand-in core (tests/fake_core.py) is made to "generate" a scripted text in small
pieces (``ScriptStream``), so the tool-call parser meets the splits a stream makes."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
import fake_core  # noqa: E402
from fake_core import FakeCore, FakeParams, FakeStream, Out, QueueFullError, ReqOut  # noqa: E402
from server_harness import serve_args, serve_state  # noqa: E402

from chunklocal.server import generate  # noqa: E402
from chunklocal.server.app import ServerConfig, ServerState  # noqa: E402
from chunklocal.server.params import ServeLimits  # noqa: E402
from chunklocal.server.tool_choice import AUTO_NEEDS_FLAGS  # noqa: E402

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
USER = [{"role": "user", "content": "weather in Paris?"}]
TWO_CALLS = '[get_weather(city="Paris"), get_time(zone="CET", days=[1, [2, 3]])]'

# A template that renders tools, tool calls (iterating each call's arguments as a dict, as
# Llama-4's does) and tool results.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|header_start|>system<|header_end|>\n\ntools:"
    "{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|eot|>{% endif %}"
    "{% for m in messages %}<|header_start|>{{ m['role'] }}<|header_end|>\n\n"
    "{% if m['tool_calls'] %}{% for tc in m['tool_calls'] %}{{ tc['function']['name'] }}("
    "{% for k, v in tc['function']['arguments'].items() %}{{ k }}={{ v }}{% endfor %})"
    "{% endfor %}{% else %}{% if m['role'] == 'tool' %}[{{ m['tool_call_id'] }}]{% endif %}"
    "{{ m['content'] }}{% endif %}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}")


class ScriptStream(FakeStream):
    """Outputs ``core.script`` in pieces of ``core.piece`` characters, one per token, and
    finishes with "stop" at its end (or "length" at max_tokens)."""

    def _pieces(self):
        text, size = self.core.script, getattr(self.core, "piece", 3)
        return [text[i:i + size] for i in range(0, len(text), size)]

    def _snapshot(self, k, reason):
        pieces = self._pieces()[:k]
        toks = [sum(map(ord, p)) % self.core.vocab_size for p in pieces]
        lps = [{t: -1.0} for t in toks] if self.params.logprobs is not None else None
        outs = [Out(i, "".join(pieces), list(toks), None, lps, reason)
                for i in range(self.params.n)]
        return ReqOut(self.request_id, self.prompt, self.ids, outs, reason is not None)

    async def aiter(self):
        total = len(self._pieces())
        try:
            for k in range(1, min(total, self.params.max_tokens) + 1):
                await asyncio.sleep(0)
                reason = ("stop" if k == total else
                          "length" if k == self.params.max_tokens else None)
                yield self._snapshot(k, reason)
        finally:
            self.core.live.pop(self.request_id, None)


class Served:
    """A running server (server_harness.Served) over a scripted fake core, with an openai
    client."""

    def __init__(self, core, running):
        self.core, self.running = core, running
        self.url, self.http = running.url, running.client
        self.openai = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def chat(self, **kw):
        return self.openai.chat.completions.create(model="tiny", **{"messages": USER, **kw})

    def prompt_text(self, tokenizer):
        return tokenizer.decode(self.core.added[-1].ids)


@pytest.fixture
def serve(monkeypatch, tokenizer):
    monkeypatch.setattr(generate, "sampling_params_class", lambda: FakeParams)
    monkeypatch.setattr(generate, "_queue_full_class", lambda: QueueFullError)
    monkeypatch.setattr(fake_core, "FakeStream", ScriptStream)
    started = []

    def start(script="", auto=True, parser="llama4_pythonic", **config):
        core = FakeCore(tokenizer)
        core.script = script
        state = ServerState(ServerConfig(["tiny"], "/models/tiny", None, ServeLimits(),
                                         chat_template=TOOL_TEMPLATE,
                                         enable_auto_tool_choice=auto,
                                         tool_call_parser=parser, **config))
        state.set_core(core)
        served = Served(core, serve_state(state))
        started.append(served)
        return served

    yield start
    for s in started:
        s.running.stop()


def calls_of(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in
            message.tool_calls or ()]


def assemble(chunks):
    """Per choice index: (content, [(id, name, arguments)], finish_reason) of a stream."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            o = out.setdefault(c.index, {"content": "", "calls": {}, "finish": None})
            o["content"] += c.delta.content or ""
            for tc in c.delta.tool_calls or ():
                call = o["calls"].setdefault(tc.index, {"id": None, "name": "", "args": ""})
                if tc.id:
                    assert call["id"] is None, "a call's id is sent once"
                    call["id"] = tc.id
                call["name"] += (tc.function and tc.function.name) or ""
                call["args"] += (tc.function and tc.function.arguments) or ""
            if c.finish_reason is not None:
                assert o["finish"] is None, "one finish reason per choice"
                o["finish"] = c.finish_reason
    return {i: (o["content"], [(c["id"], c["name"], c["args"]) for _, c in
                               sorted(o["calls"].items())], o["finish"])
            for i, o in out.items()}


def _bad(s, status=400, **body):
    with pytest.raises(openai.APIStatusError) as info:
        s.chat(**body)
    assert info.value.status_code == status
    return info.value.response.json()["error"]


# -- non-streamed ------------------------------------------------------------------------------
def test_tool_calls_parsed_into_message_tool_calls(serve, tokenizer):
    s = serve(TWO_CALLS)
    resp = s.chat(tools=TOOLS)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris"}),
                                        ("get_time", {"zone": "CET", "days": [1, [2, 3]]})]
    call = choice.message.tool_calls[0]
    assert call.type == "function" and re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id)
    assert len({c.id for c in choice.message.tool_calls}) == 2
    # The tools reached the chat template.
    assert "tools: get_weather get_time" in s.prompt_text(tokenizer)


def test_leading_and_trailing_text_stay_content(serve):
    s = serve('Let me check. [get_weather(city="Paris")] Done.')
    choice = s.chat(tools=TOOLS, tool_choice="auto").choices[0]
    assert choice.message.content == "Let me check.  Done."
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris"})]
    assert choice.finish_reason == "tool_calls"


def test_plain_answers_and_tool_choice_none_are_content(serve, tokenizer):
    s = serve("It is sunny.")
    choice = s.chat(tools=TOOLS).choices[0]
    assert (choice.message.content, choice.message.tool_calls) == ("It is sunny.", None)
    assert choice.finish_reason == "stop"
    s.core.script = TWO_CALLS  # "none": the tools go to the template, the output is text
    choice = s.chat(tools=TOOLS, tool_choice="none").choices[0]
    assert (choice.message.content, choice.message.tool_calls) == (TWO_CALLS, None)
    assert choice.finish_reason == "stop"
    assert "tools: get_weather" in s.prompt_text(tokenizer)


def test_a_call_cut_by_max_tokens_is_content_with_length(serve):
    s = serve(TWO_CALLS)
    choice = s.chat(tools=TOOLS, max_tokens=5).choices[0]  # 15 characters
    assert (choice.message.content, choice.message.tool_calls) == (TWO_CALLS[:15], None)
    assert choice.finish_reason == "length"
    chunks = list(s.chat(tools=TOOLS, max_tokens=5, stream=True))
    assert assemble(chunks)[0] == (TWO_CALLS[:15], [], "length")
    choice = s.chat(tools=TOOLS, max_tokens=11).choices[0]  # the first call is complete
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris"})]
    assert choice.finish_reason == "length"


def test_parallel_tool_calls_false_keeps_the_first_call(serve):
    s = serve(TWO_CALLS)
    choice = s.chat(tools=TOOLS, parallel_tool_calls=False).choices[0]
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris"})]
    streamed = assemble(s.chat(tools=TOOLS, parallel_tool_calls=False, stream=True))[0]
    assert [(n, json.loads(a)) for _, n, a in streamed[1]] == calls_of(choice.message)
    assert streamed[2] == "tool_calls"


# -- streamed ----------------------------------------------------------------------------------
SCRIPTS = [TWO_CALLS, 'Let me check. [get_weather(city="Paris")] Done.',
           '<|python_start|>[get_time(zone="a]b)")]<|python_end|>', "a[i] is not a call",
           '{"name": "get_weather", "parameters": {"city": "Paris"}}', "[get_weather(city="]


@pytest.mark.parametrize("piece", [1, 2, 5])
@pytest.mark.parametrize("script", SCRIPTS)
def test_streamed_tool_calls_equal_non_streamed(serve, script, piece):
    s = serve(script)
    s.core.piece = piece
    body = {"tools": TOOLS, "n": 2, "logprobs": True}
    whole = s.chat(**body)
    chunks = list(s.chat(stream=True, **body))
    streamed = assemble(chunks)
    assert sorted(streamed) == [0, 1]
    for choice in whole.choices:
        content, calls, finish = streamed[choice.index]
        assert content == (choice.message.content or "")
        assert [(n, a) for _, n, a in calls] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", i) for i, _, _ in calls)
        assert finish == choice.finish_reason
        # The tokens of text held back while it might be a call keep their logprobs.
        sent = [t.token for c in chunks for ch in c.choices if ch.index == choice.index
                and ch.logprobs for t in ch.logprobs.content]
        assert sent == [t.token for t in choice.logprobs.content]


def test_stream_never_sends_an_empty_delta_mid_stream(serve):
    s = serve('ok [get_weather(city="Paris")]')
    s.core.piece = 1
    r = s.http.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS,
                                                  "stream": True})
    events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
    assert events.pop() == "[DONE]"
    events = [json.loads(e) for e in events]
    deltas = [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in events]
    assert deltas[0] == ({"role": "assistant", "content": ""}, None)
    assert all(d for d, reason in deltas[1:] if reason is None), deltas
    assert deltas[-1][1] == "tool_calls"
    opening = [d for d, _ in deltas if "tool_calls" in d][0]["tool_calls"][0]
    assert set(opening) == {"index", "id", "type", "function"} and opening["index"] == 0


# -- tool results fed back -----------------------------------------------------------------
def test_tool_results_render_through_the_template(serve, tokenizer):
    s = serve("It is 22C in Paris.")
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]
    choice = s.chat(messages=messages, tools=TOOLS).choices[0]
    assert (choice.message.content, choice.finish_reason) == ("It is 22C in Paris.", "stop")
    text = s.prompt_text(tokenizer)
    assert "get_weather(city=Paris)" in text and "[call_1]22C" in text
    bad = json.loads(json.dumps(messages))
    bad[1]["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
    err = _bad(s, messages=bad, tools=TOOLS)
    assert err["param"] == "messages[1].tool_calls[0].function.arguments"
    # /tokenize renders the tools too, as vLLM's does.
    tok = s.http.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    assert "tools: get_weather" in tokenizer.decode(tok["tokens"])


# -- refusals ----------------------------------------------------------------------------------
def test_auto_without_the_server_flags_is_vllms_400(serve):
    s = serve(TWO_CALLS, auto=False, parser=None)
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        err = _bad(s, **body)
        assert err["param"] == "tool_choice" and AUTO_NEEDS_FLAGS in err["message"]
    # Without tools, or with "none", nothing is parsed and nothing is refused.
    assert s.chat(tool_choice="auto").choices[0].message.content == TWO_CALLS
    assert s.chat(tools=TOOLS, tool_choice="none").choices[0].message.tool_calls is None


@pytest.mark.parametrize("choice", ["required",
                                    {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_choice_is_refused(serve, choice):
    err = _bad(serve(TWO_CALLS), tools=TOOLS, tool_choice=choice)
    assert err["param"] == "tool_choice" and "guided decoding" in err["message"]


@pytest.mark.parametrize("tools, param", [
    ([{"type": "function", "function": {"name": "get weather"}}], "tools[0].function.name"),
    ([TOOLS[0], TOOLS[0]], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}],
     "tools[0].function.parameters"),
    ([{"type": "retrieval"}], "tools[0].type"),
])
def test_bad_tools_name_the_field_path(serve, tools, param):
    err = _bad(serve(TWO_CALLS), tools=tools)
    assert err["param"] == param and err["message"].startswith(param)


# -- flags -------------------------------------------------------------------------------------
def test_tool_flags(tmp_path, capsys, monkeypatch):
    from chunklocal.server import app as server_app
    from chunklocal.server import cli as serve_cli

    (tmp_path / "config.json").write_text("{}")
    model = str(tmp_path)
    for bad, words in ((["--enable-auto-tool-choice"], "requires --tool-call-parser"),
                       (["--tool-call-parser", "hermes"], "invalid choice")):
        with pytest.raises(SystemExit) as info:
            serve_args(model, *bad)
        assert info.value.code == 2 and words in capsys.readouterr().err
    args = serve_args(model, "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json")
    seen = []

    class Stop(Exception):
        pass

    def state(config):
        seen.append(config)
        raise Stop

    monkeypatch.setattr(server_app, "ServerState", state)
    monkeypatch.setattr(serve_cli.signal, "signal", lambda *a: None)
    with pytest.raises(Stop):
        serve_cli.main(args)
    assert (seen[0].enable_auto_tool_choice, seen[0].tool_call_parser) == (True, "llama3_json")
