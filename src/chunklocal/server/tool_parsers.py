"""Tool-call parsers for Llama-4 / Llama-3 output, as vLLM's ``--tool-call-parser`` names them.

``llama4_pythonic``: ``[get_weather(city="Paris"), f(x=[1, [2]])]``, optionally inside
``<|python_start|>`` ... ``<|python_end|>``; it also takes the JSON form below, which Llama-4
emits under Meta's own template (vLLM issue 46863: those calls were left in ``content``).
``llama3_json``: ``{"name": "f", "parameters": {...}}`` (or ``"arguments"``), several joined
by ``;`` or in a JSON list, optionally after ``<|python_tag|>``.

One scanner serves both modes: ``extract(text)`` is a stream fed the whole text at once, so
streamed content and arguments equal the non-streamed ones for every split of the text.
Rules, each a vLLM failure mode turned around:

* A call group may follow leading text (vLLM issue 22917); the text stays ``content``, and
  text after the group is content too.  A bare ``[``/``{`` opens a group only at the start
  or after a non-word character (``a[i]`` is never a candidate).
* Argument values are literals read from the AST (``ast.parse``, never ``eval``): strings,
  numbers, True/False/None (and JSON's true/false/null), nested lists/tuples/dicts with
  string keys.  No regex over the arguments (issue 30722: nested lists raised SyntaxError).
* A call is committed when its closing ``)``/``}`` arrives and it parses; text that is not a
  valid call stays content, never an exception.  If a group breaks after committed calls
  (``[f(x=1), 42]``, or output cut by max_tokens), those calls stand and the rest is content.
* Streaming holds back only text that may still become a call: from a candidate ``[``,
  ``{`` or start tag until it is decided.  Arguments are sent whole, in one piece per call,
  once the call is complete: partial-argument repair is where vLLM's streamed and
  non-streamed answers diverge (issue 56840), and a cut call cannot be taken back.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from chunklocal.server.tool_scan import Fail, Need, Scanner, json_call, pythonic_call

__all__ = ["TOOL_PARSERS", "ContentDelta", "DeltaEvent", "Llama3JsonToolParser",
           "Llama4PythonicToolParser", "ToolCall", "ToolCallDelta", "ToolCallStream",
           "ToolParser", "get_tool_parser", "json_call", "pythonic_call",
           "random_tool_call_id"]


def random_tool_call_id() -> str:
    """vLLM's tool call id form: ``chatcmpl-tool-`` and 32 random hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; ``arguments`` is a JSON object as a string (OpenAI's form)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """``message.tool_calls[i]`` of a chat completion."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ContentDelta:
    """Plain assistant text, ``delta.content``."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of ``delta.tool_calls``: the first of a call has id and name, then arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """One entry of a chunk's ``delta.tool_calls``, as OpenAI streams it."""
        function: dict[str, str] = {"arguments": self.arguments}
        if self.id is None:
            return {"index": self.index, "function": function}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name or "", **function}}


DeltaEvent = ContentDelta | ToolCallDelta


# -- streams -----------------------------------------------------------------------------------
class ToolCallStream:
    """Incremental parse of one choice's output: ``feed`` each delta, then ``finish``."""

    def __init__(self, parser: ToolParser):
        self._parser = parser
        self._text = ""
        self._pos = 0  # everything before it is decided and sent
        self._group: str | None = None  # "list" / "objects" once a group has a committed call
        self._count = 0
        self._finished = False

    def feed(self, delta_text: str) -> list[DeltaEvent]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._text += delta_text
        return self._run(final=False)

    def finish(self) -> list[DeltaEvent]:
        """The end of the output: undecided text is decided (held-back text not a call is
        content)."""
        if self._finished:
            return []
        self._finished = True
        return self._run(final=True)

    def _run(self, final: bool) -> list[DeltaEvent]:
        events: list[DeltaEvent] = []
        scan = Scanner(self._text, final, self._parser.pythonic, self._parser.json_objects)
        while self._pos < len(self._text):
            try:
                if self._group is None:
                    if not self._step_text(scan, events):
                        break
                else:
                    self._step_group(scan, events)
            except Need:
                break
        merged: list[DeltaEvent] = []
        for e in events:  # adjacent content pieces go out as one
            if isinstance(e, ContentDelta) and merged and isinstance(merged[-1], ContentDelta):
                merged[-1] = ContentDelta(merged[-1].text + e.text)
            elif not (isinstance(e, ContentDelta) and not e.text):
                merged.append(e)
        return merged

    def _content(self, end: int, events: list[DeltaEvent]) -> None:
        events.append(ContentDelta(self._text[self._pos:end]))
        self._pos = end

    def _commit(self, element: tuple[str, str, int], events: list[DeltaEvent]) -> None:
        name, arguments, end = element
        call_id = random_tool_call_id()
        events.append(ToolCallDelta(self._count, "", id=call_id, name=name))
        events.append(ToolCallDelta(self._count, arguments))
        self._count += 1
        self._pos = end

    def _step_text(self, scan: Scanner, events: list[DeltaEvent]) -> bool:
        """Send content up to the next candidate and try it; False: wait for more text."""
        start = scan.next_trigger(self._pos)
        if start is None:
            self._content(len(self._text), events)
            return True
        self._content(start, events)
        try:
            kind, element = scan.open_group(start)
        except Fail:
            self._content(start + scan.skip_failed(start), events)
            return True
        self._commit(element, events)
        self._group = kind
        return True

    def _step_group(self, scan: Scanner, events: list[DeltaEvent]) -> None:
        assert self._group is not None
        try:
            closed, element = scan.continue_group(self._group, self._pos)
        except Fail:  # the group broke: the calls so far stand, the rest is content
            self._group = None
            return
        if element is not None:
            self._commit(element, events)
        else:
            self._pos, self._group = closed, None


class ToolParser:
    """A tool-call format; ``extract`` a whole output or stream it via ``new_stream``."""

    name: ClassVar[str]
    pythonic: ClassVar[bool]  # [f(x=1), ...] lists
    json_objects: ClassVar[bool]  # {"name": ..., "parameters": ...} objects

    def new_stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content or None when there is none, calls) of a complete output."""
        stream = self.new_stream()
        content: list[str] = []
        calls: list[ToolCall] = []
        for e in stream.feed(text) + stream.finish():
            if isinstance(e, ContentDelta):
                content.append(e.text)
            elif e.id is not None:
                calls.append(ToolCall(e.id, e.name or "", ""))
            else:
                last = calls[-1]
                calls[-1] = ToolCall(last.id, last.name, last.arguments + e.arguments)
        return "".join(content) or None, calls


class Llama4PythonicToolParser(ToolParser):
    """``--tool-call-parser llama4_pythonic``: pythonic lists, and Llama-4's JSON form."""

    name = "llama4_pythonic"
    pythonic = True
    json_objects = True


class Llama3JsonToolParser(ToolParser):
    """``--tool-call-parser llama3_json``: JSON objects (``;``-separated or a JSON list)."""

    name = "llama3_json"
    pythonic = False
    json_objects = True


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "llama4_pythonic": Llama4PythonicToolParser,
    "llama3_json": Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown tool call parser {name!r}: choose one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None

