"""Tool calls in the `<tool_call>` JSON tag format, as constraints and as parsed output.

The format (Hermes / Qwen chat models, and duospec's documented default for others):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, blocks separated by a newline. `calls_constraint` makes a Lark grammar whose
every output is one or more such blocks for the given tools, each call's JSON valid under its tool's
parameter schema (tool_choice required / named); `ToolCallParser` turns generated text, streamed or
whole, into content and calls (tool_choice auto is parsed, not constrained).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from duospec.structured.constraint import Constraint, ConstraintKind

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict  # a JSON schema of the arguments object
    description: str = ""

    def as_openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI's `function.arguments`


def calls_constraint(tools: Sequence[Tool], *, single: bool = False) -> Constraint:
    """Output = tool-call blocks (one when `single`, else one or more), each calling one of `tools`."""
    call = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                       "properties": {"name": {"const": t.name}, "arguments": t.parameters}} for t in tools],
            # JSON as json.dumps writes it (the layout of duospec's JSON schemas; no whitespace padding)
            "x-guidance": {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}}
    lark = "\n".join([
        "start: call" if single else 'start: call ("\\n" call)*',
        f"call: {json.dumps(OPEN + chr(10))} %json {json.dumps(call)} {json.dumps(chr(10) + CLOSE)}",
    ])
    return Constraint(ConstraintKind.GRAMMAR, lark)


def default_tool_prompt(tools: Sequence[Tool]) -> str:
    """The system text that offers tools to a model whose chat template has no tools of its own."""
    listed = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False, separators=(",", ":")) for t in tools)
    return ("You can call functions (tools) to answer. Their signatures, one JSON object per line:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "To call one, reply with a JSON object of its name and arguments between tool_call tags, one "
            f"block per call:\n{OPEN}\n"
            '{"name": "<function name>", "arguments": {<arguments as JSON>}}\n'
            f"{CLOSE}")


class ToolCallParser:
    """Splits generated text into content and complete tool calls as it arrives. Text that may be the
    start of an opening tag is held back until it is known not to be one; a block's text is held
    until its closing tag. `feed` and `finish` return ("content", text) and ("call", ToolCall) events
    in output order; a block that never closes (max_tokens), or whose JSON is not a call, is content."""

    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False
        self.calls = 0

    def feed(self, text: str) -> list[tuple[str, object]]:
        self._buffer += text
        events: list[tuple[str, object]] = []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    return events
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE):]
                self._inside = False
                call = _parse_call(body)
                if call is None:
                    events.append(("content", OPEN + body + CLOSE))
                else:
                    self.calls += 1
                    events.append(("call", call))
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                self._content(events, self._buffer[:start])
                self._buffer, self._inside = self._buffer[start + len(OPEN):], True
                continue
            keep = _partial_tag_length(self._buffer)
            self._content(events, self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return events

    def finish(self) -> list[tuple[str, object]]:
        rest = (OPEN if self._inside else "") + self._buffer
        self._buffer, self._inside = "", False
        events: list[tuple[str, object]] = []
        self._content(events, rest)
        return events

    def _content(self, events: list, text: str) -> None:
        # the newlines between and after blocks belong to the format, not to the content
        if text and not (self.calls and not text.strip()):
            events.append(("content", text))


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict)):
        return None
    return ToolCall(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))


def _partial_tag_length(text: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of the opening tag."""
    for n in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A whole output: (its content, the calls in it)."""
    parser = ToolCallParser()
    events = parser.feed(text) + parser.finish()
    content = "".join(v for kind, v in events if kind == "content")
    return content, [v for kind, v in events if kind == "call"]
