"""Tool calls in the `<tool_call>` JSON tag format, as constraints and as parsed output.

The format (Hermes / Qwen chat models, and duospec's documented default for others):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, blocks separated by a newline. `calls_constraint` makes a Lark grammar whose
every output is one or more such blocks for the given tools, each call's JSON valid under its tool's
parameter schema (tool_choice required / named); `ToolCallParser` turns generated text, streamed or
whole, into content and calls (tool_choice auto is parsed, not constrained). A call's arguments are
the text as generated when the block reads `{"name": ..., "arguments": ...}` (the layout the
constraint forces), so a stream can send them piece by piece and end with the same text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from duospec.structured.constraint import JSON_OPTIONS, Constraint, ConstraintKind

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A block's opening up to its arguments: {"name": "<name>", "arguments": and any whitespace (complete once
# the arguments' first character is there)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\S)')
# What may still be the block's own closing brace (and the whitespace around it): held back in a stream
_TAIL = re.compile(r'\s*(\}\s*)?$')


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


def calls_constraint(tools: Sequence[Tool], *, single: bool = False, answer: dict | None = None) -> Constraint:
    """Output = tool-call blocks (one when `single`, else one or more), each calling one of `tools`; with
    `answer` (a JSON schema), either those calls or one JSON document under it (tool_choice auto with a
    response format: the model calls tools or gives its final answer in the asked shape)."""
    call = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                       "properties": {"name": {"const": t.name}, "arguments": t.parameters}} for t in tools],
            "x-guidance": JSON_OPTIONS}
    calls = "call" if single else 'call ("\\n" call)*'
    if answer is not None:
        calls += f" | %json {json.dumps({**answer, 'x-guidance': {**JSON_OPTIONS, **answer.get('x-guidance', {})}})}"
    lark = "\n".join([
        f"start: {calls}",
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
    """Splits generated text into content and tool calls as it arrives, as OpenAI streams them. Text that
    may be the start of an opening tag is held back until it is known not to be one. A block goes out
    as it is generated once it opens as a call does (`{"name": "...", "arguments": `): ("call_start",
    name), then ("arguments", text) pieces whose concatenation is the call's `arguments` (as generated;
    the block's closing brace held back until the block closes). A block cut at max_tokens, or whose
    JSON breaks after that opening, ends with the pieces sent so far. A block that never opens as a
    call is content, unless its JSON turns out to be a call in another layout (then it goes out whole
    at its close). `feed` and `finish` return ("content", text), ("call_start", name) and ("arguments",
    text) events in output order. `single` (parallel_tool_calls false): what follows the first call is
    dropped, calls and text alike (the turn ends at its call, as OpenAI's does)."""

    def __init__(self, single: bool = False) -> None:
        self.single = single
        self._buffer = ""
        self._inside = False
        self.calls = 0
        self._head: re.Match | None = None  # the open block's opening, once complete
        self._sent = 0  # ... and how much of its arguments went out

    def feed(self, text: str) -> list[tuple[str, object]]:
        self._buffer += text
        events: list[tuple[str, object]] = []
        while True:
            if self._called_once():
                self._buffer = ""
                return events
            if self._inside:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    self._stream_call(events, self._buffer[:len(self._buffer) - _partial_length(self._buffer, CLOSE)])
                    return events
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE):]
                self._inside = False
                self._end_call(events, body)
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                self._content(events, self._buffer[:start])
                self._buffer, self._inside = self._buffer[start + len(OPEN):], True
                continue
            keep = _partial_length(self._buffer, OPEN)
            self._content(events, self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return events

    def finish(self) -> list[tuple[str, object]]:
        if self._called_once():
            self._buffer = ""
            return []
        if self._inside and self._head is not None:  # cut at max_tokens: the call ends with what was sent
            self._buffer, self._inside, self._head, self._sent = "", False, None, 0
            return []
        rest = (OPEN if self._inside else "") + self._buffer
        self._buffer, self._inside = "", False
        events: list[tuple[str, object]] = []
        self._content(events, rest)
        return events

    def _called_once(self) -> bool:
        return self.single and self.calls > 0 and not self._inside

    def _stream_call(self, events: list, body: str) -> None:
        """An open block's text so far: its name once complete, then its arguments but what may be
        the block's closing brace."""
        if self._head is None:
            self._head = _HEAD.match(body)
            if self._head is None:
                return
            self.calls += 1
            events.append(("call_start", json.loads(self._head.group(1))))
        arguments = body[self._head.end():]
        ready = arguments[: _TAIL.search(arguments).start()]
        if len(ready) > self._sent:
            events.append(("arguments", ready[self._sent:]))
            self._sent = len(ready)

    def _end_call(self, events: list, body: str) -> None:
        """A closed block: the rest of its arguments; or, if it never opened as a call, content or a
        call in another layout, whole."""
        self._stream_call(events, body)
        call = _parse_call(body)
        if self._head is None and call is None:
            events.append(("content", OPEN + body + CLOSE))
        elif self._head is None:
            self.calls += 1
            events += [("call_start", call.name), ("arguments", call.arguments)]
        elif call is not None:
            sent = body[self._head.end(): self._head.end() + self._sent]
            if call.arguments.startswith(sent) and len(call.arguments) > len(sent):
                events.append(("arguments", call.arguments[len(sent):]))
        self._head, self._sent = None, 0

    def _content(self, events: list, text: str) -> None:
        # the newlines between and after blocks belong to the format, not to the content
        if text and not (self.calls and not text.strip()):
            events.append(("content", text))


def _parse_call(body: str) -> ToolCall | None:
    """The call a block's text holds; its arguments as generated where the block has the format's
    layout (name, then arguments), else as json.dumps writes them."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict)):
        return None
    head = _HEAD.match(body)
    if head is not None and list(obj) == ["name", "arguments"]:
        raw = body[head.end(): body.rindex("}")].rstrip()
        return ToolCall(obj["name"], raw)
    return ToolCall(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))


def _partial_length(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(text: str, *, single: bool = False) -> tuple[str, list[ToolCall]]:
    """A whole output: (its content, the calls in it), as the stream of it gives them."""
    parser = ToolCallParser(single)
    content, calls = "", []
    for kind, value in parser.feed(text) + parser.finish():
        if kind == "content":
            content += value
        elif kind == "call_start":
            calls.append(ToolCall(value, ""))
        else:
            calls[-1] = ToolCall(calls[-1].name, calls[-1].arguments + value)
    return content, calls
