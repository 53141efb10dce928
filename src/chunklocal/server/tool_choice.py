"""``tools`` / ``tool_choice`` of a chat request: validation and what the server does with them.

Validation follows vLLM's ``check_tool_usage`` and OpenAI's schema; every refusal is a
``ToolRequestError`` (a ``ValueError``) whose ``param`` is the field path, e.g.
``tools[1].function.name``, so the server answers a 400 naming field and value.

Behaviour (this server has no guided decoding, which vLLM uses to force calls):

* no ``tools`` (absent, null or ``[]``): nothing to call; ``tool_choice`` "none"/"auto"/null
  are accepted (they were before), "required" or a named function are refused.
* ``tool_choice`` "none": the tools still go to the chat template (vLLM's default), the
  output is not parsed: plain content.
* "auto" (the default when ``tools`` is set, as in vLLM and OpenAI): needs the server run
  with ``--enable-auto-tool-choice --tool-call-parser NAME``; otherwise 400 with vLLM's own
  message.  The output is parsed by that parser.
* "required" and ``{"type": "function", "function": {"name": ...}}``: refused with a 400
  until guided decoding exists.  The model cannot be forced to call, and filtering its answer
  afterwards would silently drop text or calls (and cannot un-send a stream).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from chunklocal.server.tool_parsers import ToolCall, ToolParser, get_tool_parser

__all__ = ["AUTO_NEEDS_FLAGS", "ToolPolicy", "ToolRequestError", "check_tool_choice",
           "check_tool_flags", "check_tools", "finish_reason", "tool_policy"]

AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


class ToolRequestError(ValueError):
    """A refused ``tools`` / ``tool_choice``; ``param`` is the offending field's path."""

    def __init__(self, message: str, param: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def _unknown(obj: dict[str, Any], allowed: set[str], path: str) -> None:
    extra = sorted(set(obj) - allowed, key=str)
    if extra:
        raise ToolRequestError(f"unknown field {extra[0]!r} (allowed: "
                               f"{', '.join(sorted(allowed))})", f"{path}.{extra[0]}")


def check_tools(tools: object) -> list[dict[str, Any]] | None:
    """The request's tools, checked; None when there are none (absent, null or [])."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ToolRequestError(f"must be a list of tools, got {tools!r:.80}", "tools")
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        path = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ToolRequestError(f"must be an object, got {tool!r:.80}", path)
        _unknown(tool, _TOOL_KEYS, path)
        if tool.get("type", "function") != "function":
            raise ToolRequestError(f"only type 'function' is served, got {tool['type']!r:.80}",
                                   f"{path}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolRequestError(f"must be an object, got {fn!r:.80}", f"{path}.function")
        _unknown(fn, _FUNCTION_KEYS, f"{path}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolRequestError(f"must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-', got "
                                   f"{name!r:.80}", f"{path}.function.name")
        if name in seen:
            raise ToolRequestError(f"{name!r} is already the name of tools[{seen[name]}]",
                                   f"{path}.function.name")
        seen[name] = i
        for key, kind, what in (("description", str, "a string"),
                                ("parameters", dict, "a JSON Schema object"),
                                ("strict", bool, "a boolean")):
            value = fn.get(key)
            if value is not None and not isinstance(value, kind):
                raise ToolRequestError(f"must be {what}, got {value!r:.80}",
                                       f"{path}.function.{key}")
    return tools or None


def check_tool_choice(tool_choice: object,
                      tools: list[dict[str, Any]] | None) -> str | dict[str, Any]:
    """``tool_choice`` checked against the (checked) tools; null means "auto" with tools,
    "none" without.  Returns "none", "auto", "required" or the named-function object."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ToolRequestError(f"invalid value {tool_choice!r:.80}: only \"none\", "
                                   "\"auto\", \"required\" or a named function "
                                   '{"type": "function", "function": {"name": ...}}',
                                   "tool_choice")
        if tool_choice == "required" and not tools:
            raise ToolRequestError("\"required\" needs tools: `tools` is not set",
                                   "tool_choice")
        return tool_choice
    if not isinstance(tool_choice, dict):
        raise ToolRequestError(f"must be a string or an object, got {tool_choice!r:.80}",
                               "tool_choice")
    _unknown(tool_choice, _TOOL_KEYS, "tool_choice")
    if tool_choice.get("type") != "function":
        raise ToolRequestError(f"must be 'function', got {tool_choice.get('type')!r:.80}",
                               "tool_choice.type")
    fn = tool_choice.get("function")
    if not isinstance(fn, dict):
        raise ToolRequestError(f"must be an object {{\"name\": ...}}, got {fn!r:.80}",
                               "tool_choice.function")
    _unknown(fn, {"name"}, "tool_choice.function")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ToolRequestError(f"must be a non-empty string, got {name!r:.80}",
                               "tool_choice.function.name")
    names = [t["function"]["name"] for t in tools or ()]
    if name not in names:
        raise ToolRequestError(f"{name!r} matches none of `tools` (names: "
                               f"{', '.join(names) or 'none: tools is not set'})",
                               "tool_choice.function.name")
    return tool_choice


@dataclass(frozen=True)
class ToolPolicy:
    """What to do with a request's tools.

    ``tools``: pass to ``apply_chat_template(..., tools=...)`` (None: no tools kwarg).
    ``parser``: run on the output (None: the output is plain content)."""

    tools: list[dict[str, Any]] | None
    choice: str
    parser: ToolParser | None


def tool_policy(tools: object, tool_choice: object, *, auto_tool_choice: bool,
                tool_call_parser: str | None) -> ToolPolicy:
    """Check a request's ``tools`` / ``tool_choice`` against the server's flags."""
    checked = check_tools(tools)
    choice = check_tool_choice(tool_choice, checked)
    if isinstance(choice, dict) or choice == "required":
        shown = choice["function"]["name"] if isinstance(choice, dict) else choice
        raise ToolRequestError(
            f"{shown!r} is not served: forcing a tool call needs guided decoding, which this "
            "server does not have; use \"auto\" (server run with --enable-auto-tool-choice) "
            "or \"none\"", "tool_choice")
    if checked is None or choice == "none":
        return ToolPolicy(checked, "none", None)
    if not auto_tool_choice or tool_call_parser is None:
        raise ToolRequestError(AUTO_NEEDS_FLAGS, "tool_choice")
    return ToolPolicy(checked, "auto", get_tool_parser(tool_call_parser)())


def check_tool_flags(enable_auto_tool_choice: bool,
                     tool_call_parser: str | None) -> type[ToolParser] | None:
    """Server flags, checked at start-up as vLLM does: the parser class, or None."""
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    return None if tool_call_parser is None else get_tool_parser(tool_call_parser)


def finish_reason(calls: list[ToolCall] | int, reason: str | None) -> str | None:
    """"tool_calls" when the output called tools and stopped by itself (EOS / stop string);
    "length" and "abort" are kept, so a cut answer still says it was cut."""
    called = calls if isinstance(calls, int) else len(calls)
    return "tool_calls" if called and reason == "stop" else reason
