"""Structured output through the real server's OpenAI API, with the official `openai` client:
response_format json_schema / json_object, tools with tool_choice required / named / auto (plain and
streamed), and bad input as 400s naming the field."""

from __future__ import annotations

import json

import pytest

from duospec.coordinator.config import ServerSettings
from server_support import running_server, server_coordinator
from test_server_http import TENANTS, _free_port, client

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MESSAGES = [{"role": "user", "content": "What is the weather like?"}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
          "properties": {"city": {"enum": ["paris", "oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["unit", "days"],
           "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 5}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {},
                                                                     "additionalProperties": False}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def long_chat_pair(tmp_path_factory):
    """The tiny pair with a chat template and a 1,024-position context: the default tool prompt of two
    tools is ~600 tokens of this small byte-level vocabulary."""
    from transformers import AutoTokenizer

    from tiny_models import CHAT_TEMPLATE, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("structured-http-models")
    pair = [make_tiny_checkpoint(root / "target", "llama", seed=1, max_position_embeddings=1024),
            make_tiny_checkpoint(root / "draft", "llama", seed=2, hidden_size=32, num_layers=1,
                                 max_position_embeddings=1024)]
    for directory in pair:
        tok = AutoTokenizer.from_pretrained(str(directory))
        tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(str(directory))
    return tuple(pair)


@pytest.fixture
async def harness(long_chat_pair):
    settings = ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=_free_port())
    async with running_server(server_coordinator(long_chat_pair), settings, tenants=TENANTS) as h:
        h.base_url = f"http://127.0.0.1:{h.server.http_port}/v1"
        h.target = long_chat_pair[0]
        yield h


def _json_schema_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "forecast", "schema": schema, "strict": True}}


async def _stream(h, **kwargs):
    """(content, {index: {id, name, arguments, deltas}}, finish_reason) of a streamed chat completion."""
    content, calls, finish = "", {}, None
    stream = await client(h).chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **kwargs)
    async for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": "", "deltas": 0})
            assert entry["id"] is None or call.id is None, "a call's id comes once, in its first delta"
            entry["deltas"] += 1
            entry["id"] = entry["id"] or call.id
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("mode", ["off", "pearl"])
async def test_json_schema_response_format_validates_plain_and_streamed(harness, mode):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                  response_format=_json_schema_format(), extra_body={"speculation": {"mode": mode}})
    reply = await client(harness).chat.completions.create(**kwargs)
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert reply.choices[0].finish_reason == "stop"
    content, calls, finish = await _stream(harness, **{k: v for k, v in kwargs.items() if k not in ("model", "messages")})
    assert content == text and not calls and finish == "stop"


async def test_json_object_response_format_gives_an_object(harness):
    reply = await client(harness).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=120, temperature=0, response_format={"type": "json_object"})
    choice = reply.choices[0]
    if choice.finish_reason == "stop":  # a random model may still be writing a string at max_tokens
        assert isinstance(json.loads(choice.message.content), dict)
    assert choice.message.content.startswith("{")


async def test_named_tool_choice_calls_that_tool_plain_and_streamed(harness):
    kwargs = dict(max_tokens=200, temperature=0, tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    reply = await client(harness).chat.completions.create(model="tiny", messages=MESSAGES, **kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, (choice, reply.usage)
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    content, calls, finish = await _stream(harness, **kwargs)
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == call.function.arguments
    assert calls[0]["deltas"] > 1  # the arguments streamed in pieces, as they were generated


async def test_required_tool_choice_gives_valid_calls_of_the_offered_tools(harness):
    for seed in (1, 2):
        kwargs = dict(max_tokens=400, temperature=1.0, seed=seed, tools=TOOLS, tool_choice="required")
        reply = await client(harness).chat.completions.create(model="tiny", messages=MESSAGES, **kwargs)
        choice = reply.choices[0]
        assert choice.message.tool_calls, choice.message.content
        assert choice.finish_reason in ("tool_calls", "length")
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
        _, calls, finish = await _stream(harness, **kwargs)  # seeded: the same calls, streamed by index
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert finish == choice.finish_reason


async def test_required_without_parallel_calls_gives_one_call(harness):
    reply = await client(harness).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=200, temperature=1.0, seed=3, tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1


async def test_auto_offers_the_tools_in_the_prompt_and_answers(harness):
    reply = await client(harness).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12,
                                                          temperature=0, tools=TOOLS)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    from transformers import AutoTokenizer

    request = harness.coordinator.started[-1]
    prompt = AutoTokenizer.from_pretrained(str(harness.target)).decode(list(request.prompt_token_ids))
    assert "<tools>" in prompt and "get_weather" in prompt and request.constraint is None


@pytest.mark.parametrize("kwargs, param, words", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0].function.name", "letters"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}],
          tool_choice="required"), "tools", "frobnicate"),
    (dict(response_format=_json_schema_format({"type": "frobnicate"})), "response_format", "frobnicate"),
    (dict(response_format={"type": "yaml"}), "response_format", "json_schema"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"}), "guided_regex",
     "cannot be combined with response_format"),
    (dict(tools=TOOLS, extra_body={"guided_regex": "a+"}), "tool_choice", "combine with a JSON response format"),
    (dict(tools=TOOLS, tool_choice="required", extra_body={"guided_choice": ["a"]}), "tool_choice", "combine with a JSON"),
    (dict(extra_body={"guided_choice": []}), "guided_choice", "non-empty list"),
    (dict(extra_body={"guided_json": {"type": "frobnicate"}}), "guided_json", "frobnicate"),
    (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs", "one of"),
    (dict(extra_body={"repetition_penalty": 1.2}), "repetition_penalty", "leave it unset or 1"),
    (dict(extra_body={"speculation": {"mode": ["pearl"]}}), "speculation.mode", "use one of"),
    (dict(extra_body={"chat_template_kwargs": {"tokenize": True}}), "chat_template_kwargs", "set by the server"),
    (dict(extra_body={"chat_template_kwargs": [1]}), "chat_template_kwargs", "template variables"),
])
async def test_bad_structured_requests_are_400s_naming_the_field(harness, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        await client(harness).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **kwargs)
    error = info.value.body
    assert error["param"] == param and words in error["message"], error


async def test_an_agents_history_with_tool_calls_and_results_is_rendered(harness):
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "ping", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "ping", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "pong"},
        {"role": "tool", "tool_call_id": "call_2", "content": "pong again"},
    ]
    reply = await client(harness).chat.completions.create(model="tiny", messages=history, max_tokens=4,
                                                          temperature=0, tools=TOOLS)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(str(harness.target)).decode(list(harness.coordinator.started[-1].prompt_token_ids))
    assert '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>' in prompt
    # the results of one turn's calls are one user turn ("" arguments are a call without any)
    assert prompt.count('{"name": "ping", "arguments": {}}') == 2
    assert "<tool_response>\npong\n</tool_response>\n<tool_response>\npong again\n</tool_response>" in prompt
    with pytest.raises(openai.BadRequestError) as info:
        await client(harness).chat.completions.create(model="tiny", max_tokens=4, messages=[
            {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{x"}}]}])
    assert info.value.body["param"] == "messages[0].tool_calls[0].function.arguments"


@pytest.mark.parametrize("parallel", [True, False])
async def test_auto_with_a_response_format_gives_valid_calls_or_a_valid_answer(harness, parallel):
    """tool_choice auto and a json_schema: the output is tool calls or the answer in that schema, and
    nothing else; parallel_tool_calls false, one call at most. Sampled with several seeds, so both
    branches are taken."""
    branches = set()
    for seed in range(6):
        kwargs = dict(max_tokens=300, temperature=1.0, seed=seed, tools=TOOLS, response_format=_json_schema_format(),
                      parallel_tool_calls=parallel)
        reply = await client(harness).chat.completions.create(model="tiny", messages=MESSAGES, **kwargs)
        choice = reply.choices[0]
        if choice.message.tool_calls:
            branches.add("calls")
            assert choice.finish_reason == "tool_calls" and (parallel or len(choice.message.tool_calls) == 1)
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
            _, calls, finish = await _stream(harness, **kwargs)  # seeded: the same calls, streamed
            assert finish == "tool_calls" and [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
                (c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        else:
            branches.add("answer")
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert branches == {"calls", "answer"}


async def test_vllm_structured_output_fields_constrain_chat_and_completions(harness):
    """Clients written for vLLM send guided_choice / guided_regex / guided_json or structured_outputs."""
    async def chat(**extra):
        reply = await client(harness).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60,
                                                              temperature=0, extra_body=extra)
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    choices = ["sunny", "rainy", "snow and wind"]
    assert (await chat(guided_choice=choices))[0] in choices
    assert (await chat(structured_outputs={"choice": choices}))[0] in choices
    assert (await chat(guided_choice=choices, chat_template_kwargs={"enable_thinking": False}))[0] in choices
    for extra in ({"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA)}, {"structured_outputs": {"json": SCHEMA}}):
        text, finish = await chat(**extra)
        assert finish == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    reply = await client(harness).completions.create(model="tiny", prompt="The forecast:", max_tokens=20,
                                                     temperature=0, extra_body={"guided_regex": "[0-9]{2,4} ?(C|F)"})
    import re

    assert re.fullmatch("[0-9]{2,4} ?(C|F)", reply.choices[0].text) and reply.choices[0].finish_reason == "stop"


async def test_one_model_is_retrieved_by_its_id(harness):
    model = await client(harness).models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        await client(harness).models.retrieve("nope")
    assert "GET /v1/models" in info.value.body["message"]
