"""The `<tool_call>` format: the grammar of tool_choice required / named admits exactly calls of the
offered tools with valid arguments, and the parser finds the same calls however the text is streamed."""

from __future__ import annotations

import json
import pathlib

import pytest

from duospec.structured.llguidance_backend import LLGuidanceBackend
from duospec.structured.tools import CLOSE, OPEN, Tool, ToolCall, ToolCallParser, calls_constraint, parse_tool_calls

MODELS = pathlib.Path(__file__).resolve().parents[2] / "models"
WEATHER = Tool("get_weather", {"type": "object", "required": ["city"], "additionalProperties": False,
                               "properties": {"city": {"type": "string"}}})
PING = Tool("ping", {"type": "object", "properties": {}, "additionalProperties": False})


def block(name, arguments):
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CLOSE}"


@pytest.fixture(scope="module")
def backend():
    return LLGuidanceBackend.from_pretrained(str(MODELS / "target"))


def _admits(backend, constraint, text: str) -> bool:
    matcher = backend.compile(constraint).matcher()
    ids = backend._tokenizer.tokenize_str(text)
    return matcher.accept_tokens(ids) == len(ids) and matcher.validate_tokens([next(iter(backend.end_tokens))]) == 1


def test_the_calls_grammar_admits_exactly_valid_calls(backend):
    required = calls_constraint([WEATHER, PING])
    assert _admits(backend, required, block("get_weather", {"city": "Oslo"}))
    assert _admits(backend, required, block("ping", {}) + "\n" + block("get_weather", {"city": "x"}))
    assert not _admits(backend, required, block("get_weather", {"town": "Oslo"}))  # not its schema
    assert not _admits(backend, required, block("unknown", {}))
    assert not _admits(backend, required, "Sure! " + block("ping", {}))
    named = calls_constraint([PING], single=True)
    assert _admits(backend, named, block("ping", {}))
    assert not _admits(backend, named, block("ping", {}) + "\n" + block("ping", {}))


def test_parsing_a_whole_output():
    text = "Let me check.\n" + block("get_weather", {"city": "Oslo"}) + "\n" + block("ping", {})
    content, calls = parse_tool_calls(text)
    assert content == "Let me check.\n"
    assert calls == [ToolCall("get_weather", '{"city": "Oslo"}'), ToolCall("ping", "{}")]
    # a block that never opened as a call stays content, closed or cut at max_tokens
    assert parse_tool_calls("a " + OPEN + '\n{"name": "x"') == ("a " + OPEN + '\n{"name": "x"', [])
    assert parse_tool_calls(OPEN + "[1]" + CLOSE) == (OPEN + "[1]" + CLOSE, [])
    # one that opened as a call is a call, whatever follows: as a stream of it has already said
    assert parse_tool_calls(OPEN + '{"name": "x", "arguments": {"a": 1' + CLOSE) == ("", [ToolCall("x", '{"a": 1')])
    # a call in another layout goes out whole at its close
    assert parse_tool_calls(OPEN + '{"arguments": {"a": 1}, "name": "x"}' + CLOSE)[1] == [ToolCall("x", '{"a": 1}')]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 1000])
def test_streamed_pieces_of_any_size_give_the_same_events(size):
    text = "Hi <tool but not a tag> " + block("ping", {}) + "\n" + block("get_weather", {"city": "<tool_call>"})
    parser, events = ToolCallParser(), []
    for i in range(0, len(text), size):
        events += parser.feed(text[i:i + size])
    events += parser.finish()
    content = "".join(v for kind, v in events if kind == "content")
    names = [v for kind, v in events if kind == "call_start"]
    assert content == "Hi <tool but not a tag> " and names == ["ping", "get_weather"]
    assert parse_tool_calls(text) == (content, [ToolCall("ping", "{}"), ToolCall("get_weather", '{"city": "<tool_call>"}')])


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, 1000])
def test_a_stream_sends_each_call_as_it_is_generated(size):
    """A call's name as soon as it is complete, then its arguments in pieces that add up
    to the arguments a whole parse gives (the text as generated, braces inside strings included)."""
    text = block("get_weather", {"city": "Os}lo", "n": {"a": [1, 2]}}) + "\n" + block("ping", {})
    parser, events = ToolCallParser(), []
    for i in range(0, len(text), size):
        events += parser.feed(text[i:i + size])
    events += parser.finish()
    calls = []
    for kind, value in events:
        assert kind in ("call_start", "arguments"), (kind, value)
        if kind == "call_start":
            calls.append([value, ""])
        else:
            calls[-1][1] += value
    assert [ToolCall(n, a) for n, a in calls] == parse_tool_calls(text)[1]
    assert json.loads(calls[0][1]) == {"city": "Os}lo", "n": {"a": [1, 2]}}
    if size == 1:  # the name went out before the arguments were complete
        first_arguments = next(i for i, (kind, _) in enumerate(events) if kind == "arguments")
        assert events[0] == ("call_start", "get_weather") and first_arguments == 1
        assert len([e for e in events if e[0] == "arguments"]) > 2


def test_a_call_cut_at_max_tokens_ends_with_what_was_sent():
    parser = ToolCallParser()
    events = parser.feed(OPEN + '\n{"name": "ping", "arguments": {"x": "abc') + parser.finish()
    assert events == [("call_start", "ping"), ("arguments", '{"x": "abc')]


def test_auto_with_a_response_format_admits_calls_or_the_answer_and_nothing_else(backend):
    answer = {"type": "object", "required": ["city"], "additionalProperties": False,
              "properties": {"city": {"type": "string"}}}
    either = calls_constraint([WEATHER, PING], answer=answer)
    assert _admits(backend, either, block("ping", {}) + "\n" + block("get_weather", {"city": "x"}))
    assert _admits(backend, either, json.dumps({"city": "Oslo"}))
    assert not _admits(backend, either, json.dumps({"town": "Oslo"}))  # not the answer's schema
    assert not _admits(backend, either, "Sure. " + json.dumps({"city": "Oslo"}))
    assert not _admits(backend, either, json.dumps({"city": "Oslo"}) + "\n" + block("ping", {}))
    one = calls_constraint([WEATHER, PING], single=True, answer=answer)
    assert _admits(backend, one, block("ping", {})) and _admits(backend, one, json.dumps({"city": "Oslo"}))
    assert not _admits(backend, one, block("ping", {}) + "\n" + block("ping", {}))


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_one_call_at_most_drops_what_follows_the_first_call(size):
    """parallel_tool_calls false with tool_choice auto: the turn ends at its first call."""
    text = "Checking.\n" + block("get_weather", {"city": "Oslo"}) + "\nand then\n" + block("ping", {})
    parser, events = ToolCallParser(single=True), []
    for i in range(0, len(text), size):
        events += parser.feed(text[i:i + size])
    events += parser.finish()
    assert [kind for kind, _ in events if kind == "call_start"] == ["call_start"]
    assert "".join(v for kind, v in events if kind == "content") == "Checking.\n"
    assert parse_tool_calls(text, single=True) == ("Checking.\n", [ToolCall("get_weather", '{"city": "Oslo"}')])
    # a block that is not a call is content, and does not end the turn
    assert parse_tool_calls(OPEN + "[1]" + CLOSE + block("ping", {}) + "x", single=True) == (
        OPEN + "[1]" + CLOSE, [ToolCall("ping", "{}")])


def test_one_call_at_most_with_auto_ends_the_turn_at_the_first_close():
    """parallel_tool_calls false with tool_choice auto: `</tool_call>` is a stop string, so the stream
    ends at the first block's close (cut there, as stop strings are) and the call is whole."""
    from duospec.coordinator.serving.openai_protocol import chat_request

    body = {"messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": False,
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER.parameters}}]}
    assert list(chat_request(body).stopping.stop) == [CLOSE]
    assert list(chat_request({**body, "parallel_tool_calls": True}).stopping.stop) == []
    cut = "Checking.\n" + block("get_weather", {"city": "Oslo"})[: -len(CLOSE)]
    assert parse_tool_calls(cut, single=True) == ("Checking.\n", [ToolCall("get_weather", '{"city": "Oslo"}')])


@pytest.mark.parametrize("answer, words", [
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": False}}, "false matches nothing"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"x-guidance": None}}}, "x-guidance"),
])
def test_tools_with_an_unusable_answer_schema_are_400s_naming_the_format(answer, words):
    from duospec.coordinator.serving.gateway import GatewayError
    from duospec.coordinator.serving.openai_protocol import chat_request

    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": answer,
            "tools": [{"type": "function", "function": {"name": "ping"}}]}
    with pytest.raises(GatewayError) as info:
        chat_request(body)
    assert info.value.field == "response_format" and words in str(info.value)
