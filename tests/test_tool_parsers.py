"""Tool-call parsing (llama4_pythonic, llama3_json) and tools / tool_choice checks."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunklocal.server.tool_choice import (
    AUTO_NEEDS_FLAGS,
    ToolRequestError,
    check_tool_flags,
    finish_reason,
    tool_policy,
)
from chunklocal.server.tool_parsers import (
    TOOL_PARSERS,
    ContentDelta,
    Llama3JsonToolParser,
    Llama4PythonicToolParser,
    ToolCallDelta,
    get_tool_parser,
)

PY = Llama4PythonicToolParser()
JS = Llama3JsonToolParser()


def calls_of(parser, text):
    content, calls = parser.extract(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


# -- registry ----------------------------------------------------------------------------------
def test_registry_names_vllm_parsers():
    assert set(TOOL_PARSERS) == {"llama4_pythonic", "llama3_json"}
    assert get_tool_parser("llama3_json") is Llama3JsonToolParser
    with pytest.raises(ValueError, match=r"'hermes'.*llama3_json, llama4_pythonic"):
        get_tool_parser("hermes")


# -- pythonic ----------------------------------------------------------------------------------
def test_pythonic_parallel_calls_nested_literals():
    text = '[get_weather(city="Paris", days=3), f2(x=[1, [2, 3]], y={"a": None, "b": True})]'
    content, calls = PY.extract(text)
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris", "days": 3}'),
        ("f2", '{"x": [1, [2, 3]], "y": {"a": null, "b": true}}')]
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", c.id) for c in calls)
    assert calls[0].id != calls[1].id
    assert calls[0].to_openai() == {"id": calls[0].id, "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}


def test_pythonic_tags_quotes_and_values():
    text = ("<|python_start|>[f(s='it''s', t=(1, -2.5), u=false, v=null, w='''a\"b''', "
            "k='é')]<|python_end|>")
    assert calls_of(PY, text) == (None, [("f", {"s": "its", "t": [1, -2.5], "u": False,
                                                "v": None, "w": 'a"b', "k": "é"})])
    assert '"é"' in PY.extract(text)[1][0].arguments  # ensure_ascii=False, as vLLM
    assert calls_of(PY, "[f()]") == (None, [("f", {})])
    assert calls_of(PY, "[ f(a=1) , g(b=2) , ]") == (None, [("f", {"a": 1}), ("g", {"b": 2})])


def test_pythonic_deeply_nested_lists_vllm_30722():
    text = '[search(rephrased_queries=["a", "b"], m=[[1, [2, [3, {"k": [4]}]]]], e=[])]'
    assert calls_of(PY, text) == (None, [("search", {"rephrased_queries": ["a", "b"],
                                                     "m": [[1, [2, [3, {"k": [4]}]]]],
                                                     "e": []})])


def test_pythonic_after_leading_text_vllm_22917():
    text = 'To determine the weather, I will call:\n\n[get_weather(location="Dublin, Ireland")]'
    assert calls_of(PY, text) == ("To determine the weather, I will call:\n\n",
                                  [("get_weather", {"location": "Dublin, Ireland"})])


def test_text_after_the_calls_stays_content_vllm_56840():
    assert calls_of(PY, "[f(x=1)]\nDone.") == ("\nDone.", [("f", {"x": 1})])
    assert calls_of(PY, "[f(x=1)] then [g(y=2)]") == (" then ", [("f", {"x": 1}),
                                                                 ("g", {"y": 2})])


@pytest.mark.parametrize("text", [
    "[1, 2, 3] are numbers", "[]", "[link](http://x.org)", "a[i] = f(x=1)", "[see foo(x=1)]",
    "[f(1)]", "[f(x=y)]", "[f(**kw)]", "[f(**{'a': 1})]", "[os.system(cmd='ls')]",
    "[__import__('os').system('echo pwned')]", "[f(x={1, 2})]", "[f(x=b'raw')]",
    "[f(x=1j)]", "[f(x=1e999)]", "[f(x={1: 2})]", "[f(x=1 + 2)]", "[f(x=lambda: 0)]",
    "[f(x='unterminated)]", "<|python_start|>print(1)<|python_end|>",
    "<|python_start", "<|python_end|>", "{not json}", "[f(x='a\nb')]", "[if(x=1)]",
])
def test_pythonic_non_calls_are_content(text):
    assert PY.extract(text) == (text, [])


def test_group_broken_after_a_call_keeps_the_call():
    assert calls_of(PY, "[f(x=1), 42]") == (", 42]", [("f", {"x": 1})])
    assert calls_of(PY, "[f(x=1), g(y=") == (", g(y=", [("f", {"x": 1})])  # max_tokens cut
    assert calls_of(PY, "[f(x=1)") == (None, [("f", {"x": 1})])
    assert calls_of(PY, "[f(x=1))]") == (")]", [("f", {"x": 1})])


def test_pythonic_parser_takes_llama4_json_form_vllm_46863():
    text = ('{"type": "function", "name": "Bash", "parameters": {"command": "echo hello", '
            '"timeout": 12000}}')
    assert calls_of(PY, text) == (None, [("Bash", {"command": "echo hello", "timeout": 12000})])
    tagged = '<|python_start|>{"name": "s", "parameters": {"q": "arch"}}<|python_end|>'
    assert calls_of(PY, "I'll search.\n" + tagged) == ("I'll search.\n", [("s", {"q": "arch"})])


# -- JSON --------------------------------------------------------------------------------------
def test_json_calls_tag_separators_and_aliases():
    text = ('<|python_tag|>{"name": "f", "parameters": {"a": [1, {"b": null}]}}; '
            '{"name": "g", "arguments": {"s": "x;y}"}}')
    assert calls_of(JS, text) == (None, [("f", {"a": [1, {"b": None}]}), ("g", {"s": "x;y}"})])
    listed = '[{"name": "f", "parameters": {}}, {"name": "g", "parameters": {"x": 1}}]'
    assert calls_of(JS, listed) == (None, [("f", {}), ("g", {"x": 1})])
    nested = '{"type": "function", "function": {"name": "t", "parameters": {"l": "Sydney"}}}'
    assert calls_of(JS, nested) == (None, [("t", {"l": "Sydney"})])
    as_string = '{"name": "f", "arguments": "{\\"a\\": 1}"}'
    assert calls_of(JS, as_string) == (None, [("f", {"a": 1})])


def test_json_calls_removed_from_content_with_surrounding_text():
    text = ('{"type": "function", "name": "getOpenIncidentsTool", "parameters": {}} \n\n'
            "Would you like to know more?")
    assert calls_of(JS, text) == (" \n\nWould you like to know more?",
                                  [("getOpenIncidentsTool", {})])
    assert calls_of(JS, 'Sure: {"name": "f", "parameters": {"x": 2}}') == (
        "Sure: ", [("f", {"x": 2})])


@pytest.mark.parametrize("text", [
    'Here is a user: {"name": "Alice"}', '{"name": "f", "parameters": {}, "arguments": {}}',
    '{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": {"x": NaN}}',
    '{"name": "", "parameters": {}}', '{"name": "f", "parameters": {}, "extra": 1}',
    '{"type": "code", "name": "f", "parameters": {}}', "[f(x=1)]", '{"name": "f"',
    'x{"name": "f", "parameters": {}}',
])
def test_json_non_calls_are_content(text):
    assert JS.extract(text) == (text, [])


# -- streaming ---------------------------------------------------------------------------------
def test_stream_holds_back_only_what_may_be_a_call():
    s = PY.new_stream()
    assert s.feed("Hello ") == [ContentDelta("Hello ")]
    assert s.feed("[get_") == []
    assert s.feed("weather(city='P") == []
    first, args = s.feed("aris')")
    assert first.index == 0 and first.name == "get_weather" and first.arguments == ""
    assert first.to_openai() == {"index": 0, "id": first.id, "type": "function",
                                 "function": {"name": "get_weather", "arguments": ""}}
    assert args == ToolCallDelta(0, '{"city": "Paris"}')
    assert args.to_openai() == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    assert s.feed("]") == []  # maybe <|python_end|> next
    assert s.feed(" ok") == [ContentDelta(" ok")]
    assert s.finish() == [] and s.finish() == []
    with pytest.raises(RuntimeError):
        s.feed("x")


def test_stream_releases_undecided_text():
    s = PY.new_stream()
    assert s.feed("see [1") == [ContentDelta("see [1")]  # "[1" cannot start a call
    s = PY.new_stream()
    assert s.feed("a <|py") == [ContentDelta("a ")]
    assert s.feed("thon_x") == [ContentDelta("<|python_x")]
    s = JS.new_stream()
    got = s.feed('{"name": "f", "parameters": {}}')  # sent when its "}" arrives
    assert [(e.name, e.arguments) for e in got] == [("f", ""), (None, "{}")]
    assert s.feed(" ") == [] and s.finish() == [ContentDelta(" ")]  # a ";" may have followed
    s = PY.new_stream()
    assert s.feed("[f(x=1), g(") and s.finish() == [ContentDelta(", g(")]
    # Decided as soon as the text cannot be a call any more, not at the end:
    assert PY.new_stream().feed("[f(x='a\nb") == [ContentDelta("[f(x='a\nb")]
    assert JS.new_stream().feed("{x: 1") == [ContentDelta("{x: 1")]


CORPUS = [
    '[get_weather(city="Paris", days=3), f2(x=[1, [2, 3]], y={"a": None})]',
    "<|python_start|>[f(s='''a\"b''', t='x\\'y')]<|python_end|>", "plain text, no calls",
    'To determine the weather:\n\n[get_weather(location="Dublin")]\nThanks',
    "[1, 2] and a[i] and [link](u) and <|py and [f(x=1), 42]",
    '<|python_tag|>{"name": "f", "parameters": {"a": "}"}}; {"name": "g", "arguments": {}}',
    '{"type": "function", "name": "Bash", "parameters": {"c": "ls"}} \n\nMore? {"name": "x"}',
    '[{"name": "f", "parameters": {}}, {"name": "g", "parameters": {"x": [1]}}] ok',
    "[f(x=1), g(y=", '{"name": "f", "parameters": {}};', "[f()] <|python_end|> [g(a=-1)]",
]
PIECES = ["[", "]", "{", "}", "(", ")", ",", ";", " ", "\n", "'", '"', "<|python_start|>",
          "<|python_end|>", "<|python_tag|>", "f(x=1)", "g(y=[1, [2]])", "a", "=",
          '{"name": "h", "parameters": {"q": 1}}', '"name"', ":", "\\", "é"]


def _stream(parser, text, cuts):
    s = parser.new_stream()
    bounds = [0, *sorted(set(cuts)), len(text)]
    events = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        events += s.feed(text[a:b])
    return events + s.finish()


def _check_same(parser, text, cuts):
    content, calls = parser.extract(text)
    events = _stream(parser, text, cuts)
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == (content or "")
    streamed: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.id is not None:  # the first delta of a call: id, name, then arguments
                assert e.index == len(streamed) and e.name
                streamed[e.index] = [e.name, ""]
            streamed[e.index][1] += e.arguments
    assert [tuple(v) for v in streamed.values()] == [(c.name, c.arguments) for c in calls]
    for c in calls:
        assert isinstance(json.loads(c.arguments), dict)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(CORPUS), st.lists(st.integers(0, 200)), st.sampled_from([PY, JS]))
def test_streamed_equals_non_streamed_on_corpus(text, cuts, parser):
    _check_same(parser, text, [c for c in cuts if c <= len(text)])


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=25), st.lists(st.integers(0, 300)),
       st.sampled_from([PY, JS]))
def test_streamed_equals_non_streamed_on_random_text(pieces, cuts, parser):
    text = "".join(pieces)
    _check_same(parser, text, [c for c in cuts if c <= len(text)])


def test_every_split_of_a_tagged_call():
    text = "Hi <|python_start|>[f(a=[1, [2]], b='x)'), g()]<|python_end|> bye"
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):
            _check_same(PY, text, [i, j])


# -- tools / tool_choice -----------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                           "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "f2"}}]


def policy(tools=TOOLS, choice=None, auto=True, parser="llama4_pythonic"):
    return tool_policy(tools, choice, auto_tool_choice=auto, tool_call_parser=parser)


@pytest.mark.parametrize("tools, param, words", [
    ({"name": "f"}, "tools", "must be a list"),
    ([TOOLS[0], "f"], "tools[1]", "object"),
    ([TOOLS[0], {"type": "code", "function": {"name": "f"}}], "tools[1].type", "'code'"),
    ([TOOLS[0], {"type": "function"}], "tools[1].function", "None"),
    ([TOOLS[0], {"function": {"description": "x"}}], "tools[1].function.name", "None"),
    ([TOOLS[0], {"function": {"name": "has space"}}], "tools[1].function.name", "has space"),
    ([TOOLS[0], {"function": {"name": "get_weather"}}], "tools[1].function.name", "tools[0]"),
    ([{"function": {"name": "f", "parameters": "{}"}}], "tools[0].function.parameters", "{}"),
    ([{"function": {"name": "f", "description": 3}}], "tools[0].function.description", "3"),
    ([{"function": {"name": "f", "params": {}}}], "tools[0].function.params", "unknown"),
    ([{"function": {"name": "f"}, "extra": 1}], "tools[0].extra", "unknown"),
])
def test_bad_tools_name_the_field(tools, param, words):
    with pytest.raises(ToolRequestError) as err:
        policy(tools)
    assert err.value.param == param and words in str(err.value)
    assert str(err.value).startswith(param)


@pytest.mark.parametrize("choice, param, words", [
    ("sometimes", "tool_choice", "'sometimes'"),
    (3, "tool_choice", "3"),
    ({"type": "tool", "function": {"name": "f2"}}, "tool_choice.type", "'tool'"),
    ({"type": "function"}, "tool_choice.function", "None"),
    ({"type": "function", "function": {}}, "tool_choice.function.name", "None"),
    ({"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name",
     "get_weather, f2"),
    ({"type": "function", "function": {"name": "f2"}}, "tool_choice", "guided decoding"),
    ("required", "tool_choice", "guided decoding"),
])
def test_bad_or_unserved_tool_choice(choice, param, words):
    with pytest.raises(ToolRequestError) as err:
        policy(choice=choice)
    assert err.value.param == param and words in str(err.value)


def test_tool_choice_semantics():
    auto = policy()  # tools without tool_choice: "auto", as vLLM and OpenAI default
    assert auto.choice == "auto" and isinstance(auto.parser, Llama4PythonicToolParser)
    assert auto.tools == TOOLS
    none = policy(choice="none", auto=False, parser=None)
    assert none.parser is None and none.tools == TOOLS  # still rendered, as vLLM does
    for tools in (None, []):
        p = policy(tools, "auto", auto=False, parser=None)
        assert p.tools is None and p.parser is None
    with pytest.raises(ToolRequestError, match="needs tools"):
        policy(None, "required")
    for auto_flag, parser in ((False, "llama3_json"), (True, None), (False, None)):
        with pytest.raises(ToolRequestError) as err:
            policy(auto=auto_flag, parser=parser)
        assert AUTO_NEEDS_FLAGS in str(err.value) and err.value.param == "tool_choice"


def test_server_flags_and_finish_reason():
    assert check_tool_flags(True, "llama3_json") is Llama3JsonToolParser
    assert check_tool_flags(False, None) is None
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        check_tool_flags(True, None)
    with pytest.raises(ValueError, match="'pythonic'"):
        check_tool_flags(True, "pythonic")
    _, calls = PY.extract("[f()]")
    assert finish_reason(calls, "stop") == "tool_calls"
    assert finish_reason(1, "length") == "length" and finish_reason([], "stop") == "stop"
