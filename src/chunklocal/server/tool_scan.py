"""The scanner under ``tool_parsers``: where a call group starts, ends, and what it calls.

Every method is a pure function of the text seen so far and of ``final`` (no more text will
come).  One that runs into the end of a non-final text raises ``Need`` and decides nothing,
so a decision, once made, is the same for every longer text: that is what makes a stream's
output independent of how the text was split into deltas.  ``Fail``: not a call (group).

Grammar (``WS`` is whitespace; the tags are optional, ``<|python_end|>`` only after a group)::

    group   := [start_tag WS*] (list | objects) [WS* "<|python_end|>"]
    list    := "[" WS* elem (WS* "," WS* elem)* [WS* ","] WS* "]"
    objects := object (WS* ";" WS* object)*
    elem    := call (pythonic parsers) | object
    call    := NAME "(" keyword literals ")"      object := {"name": ..., "parameters": {...}}
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

START_TAGS = ("<|python_start|>", "<|python_tag|>")
END_TAG = "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CLOSER = {")": "(", "]": "[", "}": "{"}

Element = tuple[str, str, int]  # (function name, JSON arguments, end of the call in the text)


class Need(Exception):
    """The text ends before this can be decided: wait for more."""


class Fail(Exception):
    """Not a call (or not a continuation of the group)."""


# -- argument values ---------------------------------------------------------------------------
class _NotLiteral(Exception):
    pass


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    """A JSON value from a literal expression node; anything else raises ``_NotLiteral``."""
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float) and math.isfinite(value):
            return value
        raise _NotLiteral(repr(value))  # bytes, complex, Ellipsis, inf
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out: dict[str, Any] = {}
        for key, item in zip(node.keys, node.values, strict=True):
            k = _literal(key) if key is not None else None  # None: a ``**spread``
            if not isinstance(k, str):
                raise _NotLiteral("dict keys must be strings")
            out[k] = _literal(item)
        return out
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _literal(node.operand)
        if isinstance(operand, (int, float)) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise _NotLiteral(type(node).__name__)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def pythonic_call(text: str) -> tuple[str, str] | None:
    """``name(k=v, ...)`` -> (name, JSON arguments), or None if it is not such a call."""
    try:
        node = ast.parse(text, mode="eval").body
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and not node.args):
            return None
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:  # f(**d)
                return None
            args[kw.arg] = _literal(kw.value)
        return node.func.id, _dumps(args)
    except (SyntaxError, ValueError, RecursionError, MemoryError, _NotLiteral):
        return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_JSON_KEYS = {"type", "name", "parameters", "arguments"}


def json_call(text: str) -> tuple[str, str] | None:
    """``{"name": ..., "parameters"|"arguments": {...}}`` -> (name, JSON arguments) or None.

    Also ``{"type": "function", "function": {...}}``; ``arguments`` may be a JSON string.
    Other keys are refused, so prose JSON like ``{"name": "Alice"}`` is not a call."""
    try:
        obj = json.loads(text, strict=False, parse_constant=_no_constant)
        if isinstance(obj, dict) and isinstance(obj.get("function"), dict) \
                and set(obj) <= {"type", "function"}:
            obj = {"type": obj.get("type", "function"), **obj["function"]}
        if not isinstance(obj, dict) or not set(obj) <= _JSON_KEYS \
                or obj.get("type", "function") != "function":
            return None
        name = obj.get("name")
        present = [k for k in ("parameters", "arguments") if k in obj]
        if not isinstance(name, str) or not name or len(present) != 1:
            return None
        args = obj[present[0]]
        if isinstance(args, str):
            args = json.loads(args, parse_constant=_no_constant)
        if not isinstance(args, dict):
            return None
        return name, _dumps(args)
    except (ValueError, RecursionError):
        return None


# -- spans -------------------------------------------------------------------------------------
class Scanner:
    def __init__(self, text: str, final: bool, pythonic: bool, json_objects: bool):
        self.text, self.final = text, final
        self.pythonic, self.json_objects = pythonic, json_objects

    def _end(self) -> Exception:
        """What running into the end of the text means: Need more, or (final) Fail."""
        return Fail() if self.final else Need()

    def _ws(self, i: int) -> int:
        """Skip whitespace; the end of the text right after it is undecided."""
        j = _skip_ws(self.text, i)
        if j == len(self.text):
            raise self._end()
        return j

    def _tag_at(self, i: int, tags: tuple[str, ...]) -> str | None:
        """The tag at ``i``; Need if the text ends inside one; None if there is none."""
        rest = self.text[i:i + max(map(len, tags))]
        for tag in tags:
            if rest.startswith(tag):
                return tag
            if tag.startswith(rest) and not self.final:
                raise Need()
        return None

    def next_trigger(self, pos: int) -> int | None:
        """The next place at or after ``pos`` where a group may start."""
        text = self.text
        for m in re.finditer(r"[\[{<]", text[pos:]):
            i = pos + m.start()
            c = text[i]
            if c == "<":
                rest = text[i:i + 16]
                if any(t.startswith(rest) or rest.startswith(t) for t in START_TAGS):
                    return i
            elif (c == "[" or self.json_objects) and (i == 0 or not _word(text[i - 1])):
                return i
        return None

    def skip_failed(self, start: int) -> int:
        """Characters to give to content when the candidate at ``start`` failed."""
        tag = next((t for t in START_TAGS if self.text.startswith(t, start)), None)
        return len(tag) if tag else 1

    def open_group(self, start: int) -> tuple[str, Element]:
        """The group at ``start`` and its first call: ("list" | "objects", element)."""
        i = start
        if self.text[i] == "<":
            tag = self._tag_at(i, START_TAGS)
            if tag is None:
                raise Fail()
            i = self._ws(i + len(tag))
        if self.text[i] == "[":
            i = self._ws(i + 1)
            return "list", self._element(i)
        if self.text[i] == "{" and self.json_objects:
            return "objects", self._object(i)
        raise Fail()

    def continue_group(self, kind: str, pos: int) -> tuple[int, Element | None]:
        """After a call ending at ``pos``: (end of the closed group, None) or (pos, next)."""
        text = self.text
        if kind == "list":
            i = self._ws(pos)
            if text[i] == ",":
                i = self._ws(i + 1)
                if text[i] != "]":
                    return pos, self._element(i)
            if text[i] != "]":
                raise Fail()
            return self._end_tag(i + 1), None
        j = _skip_ws(text, pos)
        if j < len(text) and text[j] == ";":
            i = self._ws(j + 1)
            if text[i] != "{":
                raise Fail()
            return pos, self._object(i)
        return self._end_tag(pos), None

    def _end_tag(self, i: int) -> int:
        """Past an ``<|python_end|>`` after whitespace at ``i``, if there is one."""
        j = _skip_ws(self.text, i)  # at the end of the text, _tag_at waits
        return j + len(END_TAG) if self._tag_at(j, (END_TAG,)) else i

    def _element(self, i: int) -> Element:
        if self.text[i] == "{" and self.json_objects:
            return self._object(i)
        if not self.pythonic:
            raise Fail()
        m = _NAME.match(self.text, i)
        if m is None:
            raise Fail()
        j = m.end()
        if j == len(self.text):
            raise self._end()
        if self.text[j] != "(":
            raise Fail()
        end = self._balanced(j, python=True)
        call = pythonic_call(self.text[i:end])
        if call is None:
            raise Fail()
        return call[0], call[1], end

    def _object(self, i: int) -> Element:
        if self.text[self._ws(i + 1)] != '"':  # a call object starts with a key
            raise Fail()
        end = self._balanced(i, python=False)
        call = json_call(self.text[i:end])
        if call is None:
            raise Fail()
        return call[0], call[1], end

    def _balanced(self, i: int, python: bool) -> int:
        """End of the bracketed span opening at ``i`` (strings skipped; mismatch: Fail)."""
        text, n = self.text, len(self.text)
        stack: list[str] = []
        while i < n:
            c = text[i]
            if c == '"' or (c == "'" and python):
                i = self._string(i, python)
                continue
            if c in "([{":
                stack.append(c)
            elif c in _CLOSER:
                if not stack or stack.pop() != _CLOSER[c]:
                    raise Fail()
                if not stack:
                    return i + 1
            i += 1
        raise self._end()

    def _string(self, i: int, python: bool) -> int:
        """End of the string literal opening at ``i`` (Python: also ''' and \"\"\")."""
        text, n, q = self.text, len(self.text), self.text[i]
        if python and text.startswith(q * 3, i):
            close, i = q * 3, i + 3
        elif python and n - i < 3 and text[i:] == q * (n - i):
            raise self._end()  # '"' or '""' at the end: maybe a triple quote
        else:
            close, i = q, i + 1
        while i < n:
            c = text[i]
            if c == "\\":
                i += 2
                continue
            if text.startswith(close, i):
                return i + len(close)
            if c == q and n - i < len(close) and close.startswith(text[i:]):
                raise self._end()
            if c == "\n" and python and len(close) == 1:
                raise Fail()
            i += 1
        raise self._end()


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _word(c: str) -> bool:
    return c.isalnum() or c == "_"
