"""OpenAI's structured output: `response_format` (chat), vLLM's `guided_*` / `structured_outputs` (both
endpoints) and `tools` / `tool_choice` (chat) into a GenerateRequest (its constraint, and the tools
offered through ChatMessages.tools_json), and tool calls back into OpenAI's response shapes.

- `response_format` `{type: json_schema, json_schema: {name, schema, strict}}` or `{type: json_object}`:
  the output is constrained to the schema (or any JSON object); `{type: text}` is free text. vLLM's
  fields map onto the same constraints (a choice is a grammar of its strings); one per request.
- `tools` with `tool_choice`:
  - `none`: the tools are not offered; free text.
  - `auto` (the default with tools): offered; free text, parsed for `<tool_call>` blocks (with
    `parallel_tool_calls: false`, the turn ends at the first block's close). With a JSON response
    format: constrained to calls or the answer in that format.
  - `required`: offered; the output is constrained to one or more tool calls (one with
    `parallel_tool_calls: false`).
  - `{type: function, function: {name}}`: offered; the output is one call to that tool.
  A response with calls has `message.tool_calls` (`content` the text around them, or null) and
  `finish_reason: "tool_calls"`; streamed, each call is one delta `{tool_calls: [{index, id, type,
  function: {name, arguments}}]}`.
- An agent's history: an assistant message with `tool_calls` is rendered as its `<tool_call>` blocks,
  a `tool` message as a user turn `<tool_response>\n...\n</tool_response>` (any chat template takes it;
  consecutive ones, one turn's parallel results, as one turn).
Pure functions, no I/O, like coordinator/serving/openai_protocol.py (which calls them).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from duospec.coordinator.serving.gateway import GatewayError
from duospec.coordinator.serving.validation import MAX_STOP_STRINGS
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


# vLLM's structured-output extensions, which clients written for it send: the older `guided_*` fields and
# the newer `structured_outputs` object, each kind onto one of our constraints.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
OUTPUT_FIELDS = ("response_format", *_GUIDED, "structured_outputs")


def apply_output_constraint(body: dict, req: pb.GenerateRequest, *, chat: bool) -> str | None:
    """Constrains the output as `response_format` (chat), `guided_*` or `structured_outputs` asks; returns
    the JSON field it came from (what a compile error names), None for free text. One of them at most."""
    given = _output_fields(body, chat)
    if len(given) > 1:
        raise _bad(given[1], f"cannot be combined with {given[0]}; send one of them")
    if not given:
        return None
    name = given[0]
    if name == "response_format":
        _response_format(body[name], req)
    elif name == "structured_outputs":
        spec = body[name]
        kinds = [k for k in ("json", "regex", "choice", "grammar") if isinstance(spec, dict) and spec.get(k) is not None]
        if not isinstance(spec, dict) or len(kinds) != 1 or set(spec) - {"json", "regex", "choice", "grammar"}:
            raise _bad(name, 'must be an object with one of "json", "regex", "choice" or "grammar"')
        _guided(kinds[0], spec[kinds[0]], f"{name}.{kinds[0]}", req)
    else:
        _guided(_GUIDED[name], body[name], name, req)
    return name


def _output_fields(body: dict, chat: bool) -> list[str]:
    return [name for name in OUTPUT_FIELDS if body.get(name) not in (None, {"type": "text"})
            and (chat or name != "response_format")]


def constraint_field(body: dict, tools: ToolRequest | None, *, chat: bool) -> str | None:
    """The JSON field a request's constraint came from, for its errors: `tools` when the tools constrain
    the output (required, named, or auto with a response format), else the output field."""
    given = _output_fields(body, chat)
    if tools is not None and (tools.choice != "auto" or given):
        return "tools"
    return given[0] if given else None


def _response_format(fmt: Any, req: pb.GenerateRequest) -> None:
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


def _guided(kind: str, value: Any, field: str, req: pb.GenerateRequest) -> None:
    if kind == "json":
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise _bad(field, f"not valid JSON: {exc}") from None
        if not isinstance(value, (dict, bool)):
            raise _bad(field, "must be a JSON schema object")
        req.constraint.json_schema = json.dumps(value)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise _bad(field, "must be a non-empty list of non-empty strings")
        req.constraint.grammar = "start: " + " | ".join(json.dumps(c) for c in value)
    elif not isinstance(value, str) or not value.strip():
        raise _bad(field, "must be a non-empty string" + (" (a Lark grammar with a `start:` rule)" if kind == "grammar" else ""))
    elif kind == "regex":
        req.constraint.regex = value
    else:
        req.constraint.grammar = value


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
    """Offer the tools (ChatMessages.tools_json) and, for required / named, constrain the output to calls.
    With a JSON response format, `auto` constrains the output to calls or a JSON answer in that format;
    `required` and named calls leave the format to the turn that answers after the tools ran."""
    if tools is None:
        return
    req.messages.tools_json = json.dumps([t.as_openai() for t in tools.tools])
    # parallel_tool_calls: false asks for one call at most (OpenAI's default allows several)
    single = body.get("parallel_tool_calls") is False
    answer = req.constraint.WhichOneof("kind")
    if answer in ("regex", "grammar"):
        raise _bad("tool_choice", "tools combine with a JSON response format only; send tool_choice none, or "
                   "a json_schema")
    if tools.choice == "auto" and answer is not None:
        schema = json.loads(req.constraint.json_schema) if answer == "json_schema" else {"type": "object"}
        if schema is False or not isinstance(schema, (dict, bool)):
            raise _bad("response_format", "a JSON schema must be an object (false matches nothing)")
        if not isinstance(schema.get("x-guidance", {}) if schema is not True else {}, dict):
            raise _bad("response_format", '"x-guidance" must be an object of options')
        req.constraint.grammar = calls_constraint(tools.tools, single=single,
                                                  answer={} if schema is True else schema).text
    elif tools.choice == "auto" and single and len(req.stopping.stop) < MAX_STOP_STRINGS:
        # one call at most: the turn ends where the first block closes (the parser then ends the call)
        req.stopping.stop.append(CLOSE)
    elif tools.choice == "required":
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
        try:  # frameworks send "" for a function without arguments
            arguments = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
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

    def __init__(self, single: bool = False) -> None:
        self._parser = ToolCallParser(single)
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
