"""Generate through a real in-process grpc.aio server: streaming, exactness, validation, reflection."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from duospec.coordinator.serving.metrics import live_sequences
from duospec.v1 import generation_pb2 as pb
from server_support import MAX_CONTEXT, MODEL, collect, request, rpc_error, running_server, server_coordinator
from exactness import hf_greedy, reference_model


@pytest.fixture
async def harness(tiny_pair):
    async with running_server(server_coordinator(tiny_pair)) as h:
        yield h


async def test_stream_deltas_concatenate_to_the_full_text_and_match_target_greedy(harness, tiny_pair):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    prompt = "def fib(n):\n    return"
    req = request(prompt, 24)
    req.stopping.ignore_eos = True
    messages = await collect(harness.stub, req)
    assert len(messages) >= 2
    ids = [t for m in messages for t in m.token_ids]
    text = "".join(m.text for m in messages)
    final = messages[-1]
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    prompt_ids = tok.encode(prompt)
    assert final.usage.prompt_tokens == len(prompt_ids)
    assert final.usage.completion_tokens == len(ids) == 24
    assert text == tok.decode(ids, skip_special_tokens=True)
    assert ids == hf_greedy(reference_model(tiny_pair[0]), prompt_ids, 24)
    assert len({m.request_id for m in messages}) == 1 and messages[0].request_id


async def test_prompt_token_ids_and_client_request_id_are_echoed(harness):
    req = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 6, 7]), request_id="mine-1",
                             stopping=pb.StoppingCriteria(max_new_tokens=4, ignore_eos=True))
    messages = await collect(harness.stub, req)
    assert {m.request_id for m in messages} == {"mine-1"}
    assert messages[-1].usage.prompt_tokens == 3


async def test_stop_string_truncates_text_and_finishes_stop(harness):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(harness.coordinator.models()[0].target_path)
    base = request("import os\n", 30)
    base.stopping.ignore_eos = True
    base_messages = await collect(harness.stub, base)
    full = "".join(m.text for m in base_messages)
    full_ids = [t for m in base_messages for t in m.token_ids]
    assert len(full) > 6
    stop = full[3:6]
    req = request("import os\n", 30)
    req.stopping.ignore_eos = True
    req.stopping.stop.append(stop)
    messages = await collect(harness.stub, req)
    assert "".join(m.text for m in messages) == full[: full.index(stop)]
    assert messages[-1].finish_reason == pb.FINISH_REASON_STOP
    # The token ids sent (and counted as usage) end with the token that completed the stop string,
    # even when speculation committed several tokens past it in one round.
    sent = [t for m in messages for t in m.token_ids]
    assert sent == full_ids[: len(sent)] and messages[-1].usage.completion_tokens == len(sent)
    assert stop in tok.decode(sent, skip_special_tokens=True)
    assert stop not in tok.decode(sent[:-1], skip_special_tokens=True)


async def test_stop_token_id_finishes_stop(harness):
    base = request("x = ", 8)
    base.stopping.ignore_eos = True
    ids = [t for m in await collect(harness.stub, base) for t in m.token_ids]
    req = request("x = ", 8)
    req.stopping.ignore_eos = True
    req.stopping.stop_token_ids.append(ids[2])
    messages = await collect(harness.stub, req)
    got = [t for m in messages for t in m.token_ids]
    assert got == ids[: ids.index(ids[2]) + 1]
    assert messages[-1].finish_reason == pb.FINISH_REASON_STOP


def _bad_requests():
    long_prompt = "def f(x): return x\n" * 200
    yield "prompt", pb.GenerateRequest(prompt="")
    yield "prompt", pb.GenerateRequest()
    yield "prompt_token_ids.ids", pb.GenerateRequest(prompt_token_ids=pb.TokenIds())
    yield "prompt_token_ids.ids[1]", pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 10**6]))
    yield "prompt", pb.GenerateRequest(prompt=long_prompt)
    yield "stopping.max_new_tokens", request("x", MAX_CONTEXT)  # prompt + new > context
    yield "stopping.max_new_tokens", request("x", 100_000)  # above the server limit
    yield "sampling.temperature", request(sampling=pb.SamplingParams(temperature=-1))
    yield "sampling.temperature", request(sampling=pb.SamplingParams(temperature=math.nan))
    yield "sampling.temperature", request(sampling=pb.SamplingParams(temperature=math.inf))
    yield "sampling.top_p", request(sampling=pb.SamplingParams(top_p=1.5))
    yield "sampling.top_p", request(sampling=pb.SamplingParams(top_p=-0.1))
    yield "stopping.stop", _with_stops(["a"] * 17)
    yield "stopping.stop[0]", _with_stops(["a" * 300])
    yield "stopping.stop[0]", _with_stops([""])
    yield "stopping.stop_token_ids[0]", _with_stop_ids([10**6])
    yield "request_id", pb.GenerateRequest(prompt="x", request_id="r" * 200)
    yield "speculation.mode", pb.GenerateRequest(prompt="x", speculation=pb.SpeculationParams(mode=99))
    yield "messages", pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]))
    yield "messages.messages[0].role", pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role="wizard", content="hi")]))


def _with_stops(stops):
    req = request("x", 4)
    req.stopping.stop.extend(stops)
    return req


def _with_stop_ids(ids):
    req = request("x", 4)
    req.stopping.stop_token_ids.extend(ids)
    return req


async def test_invalid_requests_name_the_field(harness):
    for field, req in _bad_requests():
        err = await rpc_error(harness.stub, req)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.code(), err.details())
        assert err.details().startswith(field + ":"), (field, err.details())
        assert "Traceback" not in err.details()


async def test_more_drafts_than_the_models_cap_are_refused_naming_the_cap(harness):
    """The model's cap (the larger of its configured max_draft_tokens and gamma) bounds what a request
    may ask for, in every mode; at the cap a request is served with at most that many per verify."""
    from duospec.coordinator.api import GenerationRequest, InvalidRequest
    from duospec.coordinator.config import SpeculationDefaults

    cap = harness.server.gateway.models[MODEL].max_draft_tokens
    assert cap == SpeculationDefaults().request_cap == 8
    for mode in (pb.SPECULATION_MODE_VANILLA, pb.SPECULATION_MODE_PEARL):
        asking = request("x", 4, speculation=pb.SpeculationParams(mode=mode, max_draft_tokens=cap + 1))
        err = await rpc_error(harness.stub, asking)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert err.details().startswith("speculation.max_draft_tokens:") and f"at most {cap}" in err.details()
    at_cap = request("def fib(n):", 24, speculation=pb.SpeculationParams(mode=pb.SPECULATION_MODE_VANILLA,
                                                                         max_draft_tokens=cap))
    at_cap.stopping.ignore_eos = True
    stats = (await collect(harness.stub, at_cap))[-1].stats
    assert 0 < stats.drafted_tokens <= cap * stats.target_forwards
    # the in-process entry point (bench, tests) refuses the same
    events = harness.coordinator.generate(GenerationRequest("r", (1, 2), 4, model=MODEL, max_draft_tokens=cap + 1))
    with pytest.raises(InvalidRequest, match=f"at most {cap}"):
        await events.__anext__()


async def test_unknown_model_is_not_found(harness):
    err = await rpc_error(harness.stub, pb.GenerateRequest(model="nope", prompt="x"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "nope" in err.details() and MODEL in err.details()


async def test_list_models_describes_the_served_model(harness):
    reply = await harness.stub.ListModels(pb.ListModelsRequest())
    assert [m.name for m in reply.models] == [MODEL]
    card = reply.models[0]
    assert card.max_context == MAX_CONTEXT and card.vocab_size > 0 and card.draft


async def test_health_serving_and_reflection_lists_services(harness):
    health = health_pb2_grpc.HealthStub(harness.channel)
    for service in ("", "duospec.v1.GenerationService"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(harness.channel)

    async def one_request():
        yield reflection_pb2.ServerReflectionRequest(list_services="")

    replies = [r async for r in stub.ServerReflectionInfo(one_request())]
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"duospec.v1.GenerationService", "grpc.health.v1.Health"} <= names


async def test_client_cancel_frees_the_sequence(tiny_pair):
    async with running_server(server_coordinator(tiny_pair, step_delay_s=0.02)) as h:
        req = request("def f():", 200)
        req.stopping.ignore_eos = True
        call = h.stub.Generate(req)
        first = await call.read()
        assert first.token_ids
        call.cancel()
        await _wait_for_no_live_sequences(h)
        metric = h.server.metrics.registry.get_sample_value(
            "duospec:request_success_total", {"tenant": "default", "finish_reason": "cancelled"})
        assert metric == 1.0


# Deadlines mid-stream: tests/actors/test_cancellation.py (aims the deadline from a measured run).


async def _wait_for_no_live_sequences(h, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        stats = await h.coordinator.stats()
        running = h.server.admission.running
        if live_sequences(stats) == 0 and running == 0:
            return
        assert loop.time() < deadline, f"sequence still live: {stats}, {running} streams admitted"
        await asyncio.sleep(0.05)


def hf_logprobs(target_dir, prompt_ids: list[int], ids: list[int], temperature: float | None = None):
    """transformers' log-softmax of the target (of logits / temperature when sampling) at each
    generated position: [len(ids), vocab]."""
    import torch

    model = reference_model(str(target_dir))
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1: -1].float()
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


@pytest.mark.parametrize("mode", [pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_VANILLA, pb.SPECULATION_MODE_PEARL])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_logprobs_are_the_targets_in_every_mode(harness, tiny_pair, mode, temperature):
    from transformers import AutoTokenizer

    prompt = "def fib(n):\n    return"
    req = request(prompt, 20, speculation=pb.SpeculationParams(mode=mode), logprobs=3)
    req.stopping.ignore_eos = True
    req.sampling.temperature, req.sampling.seed = temperature, 11
    messages = await collect(harness.stub, req)
    ids = [t for m in messages for t in m.token_ids]
    logprobs = [lp for m in messages for lp in m.logprobs]
    assert [lp.token_id for lp in logprobs] == ids and len(ids) == 20
    reference = hf_logprobs(tiny_pair[0], AutoTokenizer.from_pretrained(str(tiny_pair[0])).encode(prompt), ids,
                            temperature or None)
    for i, lp in enumerate(logprobs):
        assert abs(lp.logprob - float(reference[i, ids[i]])) <= 1e-4, (i, lp.logprob, float(reference[i, ids[i]]))
        top_values, top_ids = reference[i].topk(3)
        assert [t.token_id for t in lp.top] == top_ids.tolist()
        assert max(abs(t.logprob - float(v)) for t, v in zip(lp.top, top_values)) <= 1e-4


async def test_logprobs_are_off_unless_asked_and_bounded(harness):
    messages = await collect(harness.stub, request("x", 3))
    assert not any(m.logprobs for m in messages)
    err = await rpc_error(harness.stub, request("x", 3, logprobs=21))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in err.details()


def test_a_chat_template_that_refuses_the_messages_is_invalid_argument():
    from duospec.coordinator.api import ModelInfo
    from duospec.coordinator.serving.validation import RequestError, _chat_token_ids

    class Strict:
        chat_template = "{{ raise_exception('roles must alternate') }}"

        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("roles must alternate user/assistant")

    info = ModelInfo("m", "t", None, 100, 256, None)
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="a"),
                                         pb.ChatMessage(role="user", content="b")])
    with pytest.raises(RequestError) as info_:
        _chat_token_ids(messages, info, Strict())
    assert info_.value.code == "INVALID_ARGUMENT" and "roles must alternate" in str(info_.value)


def test_a_prompt_longer_than_the_context_can_hold_is_refused_before_tokenizing(tiny_pair):
    """No token covers more characters than the vocabulary's longest entry: a text longer than context
    x that cannot fit, and is refused without running the tokenizer; a text of that many tokens that
    does fit is not."""
    from transformers import AutoTokenizer

    from duospec.coordinator.api import ModelInfo, SpeculationMode
    from duospec.coordinator.config import ServerSettings
    from duospec.coordinator.serving.validation import RequestError, max_prompt_chars, validate_request

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    info = ModelInfo(MODEL, "t", None, len(tok), MAX_CONTEXT, None)
    bound = max_prompt_chars(info, tok)
    longest = max(tok.get_vocab(), key=len)
    assert bound == MAX_CONTEXT * len(longest)

    class Untouchable:
        def encode(self, *args, **kwargs):
            raise AssertionError("tokenized a prompt its length already rules out")

    def validate(req, tokenizer):
        return validate_request(req, info, tokenizer, ServerSettings(), SpeculationMode.OFF, "id",
                                max_prompt_chars=bound)

    for req, field in ((pb.GenerateRequest(prompt="x" * (bound + 1)), "prompt"),
                       (pb.GenerateRequest(messages=pb.ChatMessages(messages=[
                           pb.ChatMessage(role="user", content="x" * bound),
                           pb.ChatMessage(role="user", content="y")])), "messages")):
        with pytest.raises(RequestError) as refused:
            validate(req, Untouchable())
        assert str(refused.value).startswith(f"{field}: ") and "characters cannot fit" in str(refused.value)
    text = tok.decode(tok.convert_tokens_to_ids([longest]))
    fits = text * (MAX_CONTEXT - 1)  # as many characters per token as there can be, and still room for one
    assert len(tok.encode(fits)) < MAX_CONTEXT
    assert validate(pb.GenerateRequest(prompt=fits), tok).request.max_new_tokens >= 1


def test_a_request_without_max_new_tokens_gets_the_room_left_within_the_limits(tiny_pair):
    """As OpenAI and vLLM: unset max_new_tokens runs to the context's end, but never past the server's
    max_new_tokens_limit or its default, nor past the tenant's per-request allowance (which would
    refuse the request)."""
    from transformers import AutoTokenizer

    from duospec.coordinator.api import ModelInfo, SpeculationMode
    from duospec.coordinator.config import ServerSettings
    from duospec.coordinator.serving.validation import validate_request

    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    info = ModelInfo(MODEL, "t", None, len(tok), MAX_CONTEXT, None)
    prompt = [5] * 20

    def max_new(settings=ServerSettings(), allowance=None, asked=0):
        req = pb.GenerateRequest(stopping=pb.StoppingCriteria(max_new_tokens=asked))
        req.prompt_token_ids.ids.extend(prompt)
        return validate_request(req, info, tok, settings, SpeculationMode.OFF, "id",
                                token_allowance=allowance).request.max_new_tokens

    assert ServerSettings().max_new_tokens_limit >= MAX_CONTEXT
    assert max_new() == MAX_CONTEXT - len(prompt)
    assert max_new(ServerSettings(max_new_tokens_limit=50)) == 50
    assert max_new(ServerSettings(default_max_new_tokens=7)) == 7
    assert max_new(allowance=32) == 32 - len(prompt)
    assert max_new(allowance=10) == 1  # the prompt alone is past it: admission refuses it, and says why
    assert max_new(allowance=32, asked=40) == 40  # asked for: admission judges it as asked


@pytest.mark.parametrize("template, native", [
    ("{% for t in tools %}{{ t }}{% endfor %} reply with <tool_call>...</tool_call>", True),  # Hermes / Qwen
    ("{% for t in tools %}{{ t }}{% endfor %} reply with a JSON object", False),  # Llama 3's bare JSON
    ("{{ messages }}", False),  # no tools at all
])
def test_tools_go_through_the_template_only_where_it_calls_in_the_tool_call_format(template, native):
    """The parser and the constraints read `<tool_call>` blocks: a template that offers tools in that
    format gets them; any other gets duospec's system prompt, which asks for that format."""
    import json

    from duospec.coordinator.api import ModelInfo
    from duospec.coordinator.serving.validation import _chat_token_ids

    class Recording:
        chat_template = template

        def apply_chat_template(self, turns, **kwargs):
            self.turns, self.kwargs = turns, kwargs
            return "rendered"

        def encode(self, text, add_special_tokens):
            return [1, 2]

    tokenizer = Recording()
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}]
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="a")], tools_json=json.dumps(tools))
    assert _chat_token_ids(messages, ModelInfo("m", "t", None, 100, 256, None), tokenizer) == [1, 2]
    assert ("tools" in tokenizer.kwargs) == native
    offered = tokenizer.turns[0]["role"] == "system" and "<tool_call>" in tokenizer.turns[0]["content"]
    assert offered != native
    if offered:
        assert '"name":"ping"' in tokenizer.turns[0]["content"]


def test_chat_template_variables_reach_the_template_and_bad_ones_are_refused():
    """vLLM's chat_template_kwargs ({"enable_thinking": false} for Qwen3): template variables, never
    apply_chat_template's own arguments."""
    from duospec.coordinator.api import ModelInfo
    from duospec.coordinator.serving.validation import RequestError, _chat_token_ids

    class Recording:
        chat_template = "{{ messages }}"

        def apply_chat_template(self, turns, **kwargs):
            self.kwargs = kwargs
            return "rendered"

        def encode(self, text, add_special_tokens):
            return [1]

    info, tokenizer = ModelInfo("m", "t", None, 100, 256, None), Recording()

    def render(kwargs_json):
        return _chat_token_ids(pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="a")],
                                               chat_template_kwargs_json=kwargs_json), info, tokenizer)

    render('{"enable_thinking": false}')
    assert tokenizer.kwargs["enable_thinking"] is False and tokenizer.kwargs["add_generation_prompt"] is True
    for bad, words in (('{"tokenize": true}', "set by the server"), ("[1]", "JSON object"), ("{", "not valid JSON"),
                       ('{"a b": 1}', "JSON object")):
        with pytest.raises(RequestError) as info_:
            render(bad)
        assert info_.value.field == "messages.chat_template_kwargs_json" and words in str(info_.value), bad
