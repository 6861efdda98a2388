"""OpenAI's structured output on the chat API: `response_format` and `tools` / `tool_choice` into a
GenerateRequest (its constraint, and the tools offered through ChatMessages.tools_json), and tool calls
back into OpenAI's response shapes.

- `response_format` `{type: json_schema, json_schema: {name, schema, strict}}` or `{type: json_object}`:
  the output is constrained to the schema (or any JSON object); `{type: text}` is free text.
- `tools` with `tool_choice`:
  - `none`: the tools are not offered; free text.
  - `auto` (the default with tools): offered; free text, parsed for `<tool_call>` blocks.
  - `required`: offered; the output is constrained to one or more tool calls (one with
    `parallel_tool_calls: false`).
  - `{type: function, function: {name}}`: offered; the output is one call to that tool.
  A response with calls has `message.tool_calls` (`content` the text around them, or null) and
  `finish_reason: "tool_calls"`; streamed, each call is one delta `{tool_calls: [{index, id, type,
  function: {name, arguments}}]}`.
- An agent's history: an assistant message with `tool_calls` is rendered as its `<tool_call>` blocks,
  a `tool` message as a user turn `<tool_response>\n...\n</tool_response>` (any chat template takes it).
Pure functions, no I/O, like coordinator/serving/openai_protocol.py (which calls them).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from duospec.coordinator.serving.gateway import GatewayError
from duospec.structured.tools import CLOSE, OPEN, Tool, ToolCall, ToolCallParser, calls_constraint
from duospec.v1 import generation_pb2 as pb

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _bad(field: str, problem: str) -> GatewayError:
    return GatewayError("INVALID_ARGUMENT", f"{field}: {problem}", field=field)


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: str  # "auto" | "required" | "named"
    name: str | None = None  # the named tool


def apply_response_format(body: dict, req: pb.GenerateRequest) -> None:
    fmt = body.get("response_format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("response_format", 'use {"type": "text"}, {"type": "json_object"} or '
                   '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}')
    if fmt["type"] == "json_object":
        req.constraint.json_object = True
    elif fmt["type"] == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise _bad("response_format.json_schema", 'must be an object {"name": ..., "schema": {...}}')
        schema = spec.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise _bad("response_format.json_schema.schema", "must be a JSON schema object")
        req.constraint.json_schema = json.dumps(schema)


def tool_request(body: dict) -> ToolRequest | None:
    """The request's tools and how they may be called; None: no tools offered (none given, or
    tool_choice none)."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw in (None, []):
        if choice not in (None, "none"):
            raise _bad("tool_choice", "needs tools")
        return None
    if not isinstance(raw, list):
        raise _bad("tools", 'must be a list of {"type": "function", "function": {"name": ..., "parameters": {...}}}')
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(raw))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise _bad("tools", "function names must be unique")
    if choice in (None, "auto"):
        return ToolRequest(tools, "auto")
    if choice == "none":
        return None
    if choice == "required":
        return ToolRequest(tools, "required")
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise _bad("tool_choice", f"{name!r} is not one of the tools ({', '.join(names)})")
        return ToolRequest(tools, "named", name)
    raise _bad("tool_choice", 'use "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def _tool(raw: Any, field: str) -> Tool:
    if not isinstance(raw, dict) or raw.get("type", "function") != "function" or not isinstance(raw.get("function"), dict):
        raise _bad(field, 'must be {"type": "function", "function": {"name": ..., "parameters": {...}}}')
    fn = raw["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise _bad(f"{field}.function.name", "use 1-64 letters, digits, _ or -")
    parameters = fn.get("parameters", _EMPTY_PARAMETERS)
    if not isinstance(parameters, dict):
        raise _bad(f"{field}.function.parameters", "must be a JSON schema object")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise _bad(f"{field}.function.description", "must be a string")
    return Tool(name, parameters, description)


def apply_tools(tools: ToolRequest | None, body: dict, req: pb.GenerateRequest) -> None:
    """Offer the tools (ChatMessages.tools_json) and, for required / named, constrain the output."""
    if tools is None:
        return
    if body.get("response_format") not in (None, {"type": "text"}):
        raise _bad("response_format", "cannot be combined with tools; send one of them")
    req.messages.tools_json = json.dumps([t.as_openai() for t in tools.tools])
    if tools.choice == "required":
        # parallel_tool_calls: false asks for one call at most (OpenAI's default allows several)
        single = body.get("parallel_tool_calls") is False
        req.constraint.grammar = calls_constraint(tools.tools, single=single).text
    elif tools.choice == "named":
        req.constraint.grammar = calls_constraint([t for t in tools.tools if t.name == tools.name], single=True).text


def tool_turn(role: str, content: str, calls: Any, field: str) -> tuple[str, str]:
    """(role, content) of an earlier assistant turn that called tools, or of a tool's result."""
    if role == "tool":
        return "user", f"<tool_response>\n{content}\n</tool_response>"
    if not isinstance(calls, list):
        raise _bad(f"{field}.tool_calls", "must be a list of {id, type: function, function: {name, arguments}}")
    blocks = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise _bad(f"{field}.tool_calls[{j}]", 'must be {"type": "function", "function": {"name": ..., '
                       '"arguments": "<JSON text>"}}')
        try:
            arguments = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            raise _bad(f"{field}.tool_calls[{j}].function.arguments", "must be JSON text") from None
        blocks.append(f"{OPEN}\n{json.dumps({'name': fn['name'], 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}")
    return "assistant", "\n".join([content, *blocks] if content else blocks)


def tool_call_json(call: ToolCall, index: int) -> dict:
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def finish_with_calls(finish: str | None, n_calls: int) -> str | None:
    """OpenAI says "tool_calls" when the model stopped after calling; a cut at max_tokens stays "length"."""
    return "tool_calls" if n_calls and finish == "stop" else finish


class StreamedCalls:
    """A chat stream's text turned into content deltas and tool-call deltas (index counts the calls): a
    call goes out as it is generated, as OpenAI streams one: its id, type and name first, then its
    arguments in pieces (ToolCallParser)."""

    def __init__(self) -> None:
        self._parser = ToolCallParser()
        self.calls = 0

    def feed(self, text: str, *, last: bool) -> tuple[str, list[dict]]:
        events = self._parser.feed(text) + (self._parser.finish() if last else [])
        content, calls = "", []
        for kind, value in events:
            if kind == "content":
                content += value
            elif kind == "call_start":
                calls.append(tool_call_json(ToolCall(value, ""), self.calls))
                self.calls += 1
            elif calls and calls[-1]["index"] == self.calls - 1:  # arguments: one delta per call and chunk
                calls[-1]["function"]["arguments"] += value
            else:
                calls.append({"index": self.calls - 1, "function": {"arguments": value}})
        return content, calls
