"""Broken streams resumed, exactly: a gateway that dies mid-stream (`BreakingGateway`, a proxy in front
of a real server that aborts its first calls with UNAVAILABLE after k messages) and the SDK going on
at the next address of its list. The resumed result is token for token the unbroken run's, greedy
and seeded-sampled, streamed and not, constrained too; the usage ledger has one row for it. The SDK's
side alone (what it sends, when it gives up) runs against a scripted server."""

from __future__ import annotations

import asyncio
import json
import re
import time

import grpc
import pytest

import duospec
from duospec import sdk
from duospec.coordinator.tenants.ledgers import query_usage
from duospec.v1 import generation_pb2 as pb
from duospec.v1 import generation_pb2_grpc as pb_grpc
from server_support import collect, rpc_error, running_server, server_coordinator
from test_sdk import Abort, ScriptedServer, ScriptedServicer

PROMPT = "def fib(n):"
MAX_NEW = 24
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "n"],
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 9}}}


class BreakingGateway(pb_grpc.GenerationServiceServicer):
    """Forwards Generate to `upstream`; its first `breaks` calls die with UNAVAILABLE after `after`
    messages, as a client sees a gateway process killed mid-stream."""

    def __init__(self, upstream: str, after: int, breaks: int = 1):
        self.channel = grpc.aio.insecure_channel(upstream)
        self.stub = pb_grpc.GenerationServiceStub(self.channel)
        self.after, self.breaks = after, breaks
        self.requests: list[pb.GenerateRequest] = []

    async def Generate(self, request, context):
        self.requests.append(request)
        breaking = self.breaks > 0
        self.breaks -= breaking
        call = self.stub.Generate(request)
        sent = 0
        async for response in call:
            if breaking and sent == self.after:
                call.cancel()
                await context.abort(grpc.StatusCode.UNAVAILABLE, "gateway process died")
            yield response
            sent += 1


@pytest.fixture
async def served(tiny_pair, tmp_path):
    async with running_server(server_coordinator(tiny_pair), ledger_path=str(tmp_path / "usage.db")) as h:
        h.ledger_path = tmp_path / "usage.db"
        yield h


@pytest.fixture
async def breaking(served):
    """(the harness, the breaking gateway, its address, the server's address)"""
    direct = f"127.0.0.1:{served.server.port}"
    gateway = BreakingGateway(direct, after=3)
    proxy = grpc.aio.server()
    pb_grpc.add_GenerationServiceServicer_to_server(gateway, proxy)
    port = proxy.add_insecure_port("127.0.0.1:0")
    await proxy.start()
    try:
        yield served, gateway, f"127.0.0.1:{port}", direct
    finally:
        await proxy.stop(0)
        await gateway.channel.close()


def options(temperature=0.0, seed=None, **extra) -> dict:
    return dict(max_new_tokens=MAX_NEW, temperature=temperature, seed=seed, ignore_eos=True, **extra)


def sync_generate(addresses, stream: bool, **kwargs):
    with duospec.Client(addresses, timeout=60) as client:
        if not stream:
            return client.generate(PROMPT, **kwargs)
        with client.generate(PROMPT, stream=True, **kwargs) as chunks:
            chunks = list(chunks)
        return chunks


def joined(chunks) -> tuple[str, tuple[int, ...]]:
    return "".join(c.text for c in chunks), tuple(t for c in chunks for t in c.token_ids)


@pytest.mark.parametrize("stream", [False, True], ids=["result", "stream"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 1234}], ids=["greedy", "seeded"])
async def test_a_broken_stream_resumes_on_the_next_gateway_token_for_token(breaking, stream, sampling):
    h, gateway, broken, direct = breaking
    unbroken = await asyncio.to_thread(sync_generate, direct, False, **options(**sampling))
    got = await asyncio.to_thread(sync_generate, [broken, direct], stream, **options(**sampling))
    first, resumed = gateway.requests[0], h.coordinator.started[-1]
    assert not first.HasField("resume") and resumed.resumed_tokens >= 3  # it did break, and resume
    if stream:
        assert [c.finish_reason for c in got].count("length") == 1 and got[-1].finish_reason == "length"
        assert len({c.request_id for c in got}) == 1
        text, ids = joined(got)
        usage = got[-1].usage
    else:
        text, ids, usage = got.text, got.token_ids, got.usage
    assert ids == unbroken.token_ids and text == unbroken.text
    assert (usage.prompt_tokens, usage.completion_tokens) == (unbroken.usage.prompt_tokens, MAX_NEW)


async def test_the_async_client_resumes_too(breaking):
    h, gateway, broken, direct = breaking
    async with duospec.AsyncClient(direct, timeout=60) as client:
        unbroken = await client.generate(PROMPT, **options(temperature=0.7, seed=5))
    async with duospec.AsyncClient([broken, direct], timeout=60) as client:
        chunks = [c async for c in await client.generate(PROMPT, stream=True, **options(temperature=0.7, seed=5))]
    assert joined(chunks) == (unbroken.text, unbroken.token_ids) and gateway.breaks == 0


async def test_a_constrained_stream_resumes_inside_its_grammar(breaking):
    h, gateway, broken, direct = breaking
    gateway.after = 1  # a short JSON comes in few messages (the tokens the grammar forces go in bunches)
    kwargs = dict(max_new_tokens=60, json_schema=SCHEMA)
    unbroken = await asyncio.to_thread(sync_generate, direct, False, **kwargs)
    got = await asyncio.to_thread(sync_generate, [broken, direct], False, **kwargs)
    assert gateway.breaks == 0 and 1 <= h.coordinator.started[-1].resumed_tokens < len(got.token_ids)
    assert got.token_ids == unbroken.token_ids and json.loads(got.text) == json.loads(unbroken.text)


async def test_the_resumed_request_is_one_ledger_row_with_every_token(breaking):
    h, gateway, broken, direct = breaking
    got = await asyncio.to_thread(sync_generate, [broken], False, **options())  # the same address again
    assert len(gateway.requests) == 2 and gateway.requests[1].HasField("resume")
    deadline = time.monotonic() + 10
    while (rows := query_usage(h.ledger_path)) and rows[0].status_code != "OK" and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # the final write lands just after the final message
    [row] = query_usage(h.ledger_path)
    assert (row.status_code, row.finish_reason, row.completion_tokens) == ("OK", "length", MAX_NEW)
    assert row.prompt_tokens == got.usage.prompt_tokens and row.id == got.request_id


async def test_an_unseeded_sampled_stream_is_not_resumed(breaking):
    h, gateway, broken, direct = breaking
    with pytest.raises(sdk.Unavailable) as info:
        await asyncio.to_thread(sync_generate, [broken, direct], True, **options(temperature=0.8))
    message = str(info.value)
    delivered = int(re.search(r"broke after (\d+) tokens", message).group(1))
    assert delivered >= 3 and "seed=" in message and "gateway process died" in message  # 3 messages, >= 1 token each
    assert len(gateway.requests) == 1 and len(h.coordinator.started) == 1


async def test_a_broken_streams_late_end_on_the_same_gateway_leaves_the_resumed_row_alone(tiny_pair, tmp_path):
    # The broken stream's end is noticed only after its resumption, on the same gateway, has finished
    # (its cancellation late, as a dead link's can be): the row stays the resumed stream's, OK and whole.
    # (The target slowed, so the broken stream is still generating when it is cancelled.)
    async with running_server(server_coordinator(tiny_pair, step_delay_s=0.03),
                              ledger_path=str(tmp_path / "usage.db")) as served:
        served.ledger_path = tmp_path / "usage.db"
        await _a_late_end(served)


async def _a_late_end(served):
    gateway, late = served.server.gateway, asyncio.Event()
    account = gateway._account
    held = []

    async def account_late(stream):
        if not held:  # the first stream to end is the broken one
            held.append(stream)
            await late.wait()
        await account(stream)

    gateway._account = account_late
    req = pb.GenerateRequest(prompt=PROMPT, stopping=pb.StoppingCriteria(max_new_tokens=MAX_NEW, ignore_eos=True))
    call = served.stub.Generate(req)
    first = [await call.read() for _ in range(3)]
    call.cancel()
    while not held:  # the broken stream ended (cancelled mid-generation) and waits to be accounted
        await asyncio.sleep(0.01)
    again = await collect(served.stub, resumed(req, first, sum(len(r.token_ids) for r in first)))
    assert again[-1].finish_reason == pb.FINISH_REASON_LENGTH and held[0].status_code == "CANCELLED"
    [row] = query_usage(served.ledger_path)
    assert (row.status_code, row.completion_tokens) == ("OK", MAX_NEW)
    late.set()
    while gateway._row_writers:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # the late stream's accounting is over
    [row] = query_usage(served.ledger_path)
    assert (row.status_code, row.finish_reason, row.completion_tokens) == ("OK", "length", MAX_NEW)


async def test_a_resumed_request_takes_only_its_new_tokens_from_the_rate_limit(served):
    # tokens per minute: the broken stream paid for the prompt and what it delivered; the resumption
    # reserves and is charged only the tokens it adds.
    admission = served.server.admission
    reserved, used = [], []
    admit, release = admission.admit, admission.release

    async def recording_admit(tenant, tokens, model=""):
        reserved.append(tokens)
        return await admit(tenant, tokens, model)

    def recording_release(ticket, used_tokens):
        used.append(used_tokens)
        release(ticket, used_tokens)

    admission.admit, admission.release = recording_admit, recording_release
    req, responses = await first_stream(served)
    prompt = responses[-1].usage.prompt_tokens
    await collect(served.stub, resumed(req, responses, 3))
    assert reserved == [prompt + 8, 8 - 3] and used == [prompt + 8, 8 - 3]


# ---- the server refuses a resume that does not match its request --------------------------------------

async def first_stream(h, **sampling) -> tuple[pb.GenerateRequest, list[pb.GenerateResponse]]:
    req = pb.GenerateRequest(prompt=PROMPT, stopping=pb.StoppingCriteria(max_new_tokens=8, ignore_eos=True))
    for key, value in sampling.items():
        setattr(req.sampling, key, value)
    return req, await collect(h.stub, req)


def resumed(req: pb.GenerateRequest, responses, n: int) -> pb.GenerateRequest:
    out = pb.GenerateRequest()
    out.CopyFrom(req)
    out.resume.usage_id = responses[0].usage_id
    out.resume.delivered_token_ids.extend([t for r in responses for t in r.token_ids][:n])
    return out


@pytest.mark.parametrize("change, field", [
    (lambda r: setattr(r, "prompt", "def fact(n):"), "resume.usage_id"),
    (lambda r: setattr(r.sampling, "seed", 8), "resume.usage_id"),
    (lambda r: r.resume.delivered_token_ids.extend([5] * 8), "resume.delivered_token_ids"),
    (lambda r: r.sampling.ClearField("seed"), "resume"),
])
async def test_a_resume_that_does_not_match_its_request_is_invalid_argument(served, change, field):
    req, responses = await first_stream(served, temperature=0.8, seed=7)
    assert len(responses[0].usage_id) == 49 and not any(r.usage_id for r in responses[1:])
    bad = resumed(req, responses, 2)
    change(bad)
    err = await rpc_error(served.stub, bad)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(field + ":")


async def test_a_resume_of_a_stream_that_lacked_only_its_final_message_gets_that_message(served):
    req, responses = await first_stream(served)
    again = await collect(served.stub, resumed(req, responses, 8))
    assert [(list(r.token_ids), r.finish_reason) for r in again] == [([], pb.FINISH_REASON_LENGTH)]
    assert again[0].usage.completion_tokens == 8 and again[0].request_id == responses[0].request_id


# ---- the SDK's side, against a scripted server ----------------------------------------------------------

def chunk(ids, text, usage_id="", finish=pb.FINISH_REASON_UNSPECIFIED) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id="r", text=text, token_ids=ids, usage_id=usage_id, finish_reason=finish)


USAGE_ID = "ab" * 16 + "." + "cd" * 8
BROKEN = [chunk([11], "a", USAGE_ID), chunk([12], "b"), Abort(grpc.StatusCode.UNAVAILABLE, "reset")]
REST = [chunk([13], "c", USAGE_ID), chunk([], "", finish=pb.FINISH_REASON_LENGTH)]


def test_the_sdk_resumes_with_the_same_request_and_what_it_was_delivered():
    with ScriptedServer(ScriptedServicer()) as server, duospec.Client(server.address, timeout=10) as client:
        server.servicer.scripts.extend([BROKEN, REST])
        result = client.generate("x", seed=3, temperature=0.5, max_new_tokens=3)
        first, second = server.servicer.requests
    assert (result.text, result.token_ids, result.finish_reason) == ("abc", (11, 12, 13), "length")
    assert second.resume.usage_id == USAGE_ID and list(second.resume.delivered_token_ids) == [11, 12]
    second.ClearField("resume")
    assert second == first


def test_the_sdk_goes_round_its_addresses_when_one_is_down():
    with ScriptedServer(ScriptedServicer()) as server:
        with duospec.Client(["127.0.0.1:1", server.address], timeout=10) as client:
            assert client.generate("x").token_ids == (11, 12, 13, 14)
            assert client.models()[0].name == "python-tiny"  # the address that answered last first
        assert len(server.servicer.requests) == 1


def test_resume_off_leaves_a_broken_stream_an_error():
    with ScriptedServer(ScriptedServicer()) as server, duospec.Client(server.address, resume=False) as client:
        server.servicer.scripts.append(BROKEN)
        with pytest.raises(sdk.Unavailable, match="reset"):
            client.generate("x")
        assert len(server.servicer.requests) == 1


def test_a_stream_that_keeps_breaking_gives_up_after_the_retries():
    with ScriptedServer(ScriptedServicer()) as server, duospec.Client(server.address, max_retries=2) as client:
        server.servicer.scripts.extend([BROKEN, [Abort(grpc.StatusCode.UNAVAILABLE, "down")],
                                        [Abort(grpc.StatusCode.UNAVAILABLE, "still down")]])
        with pytest.raises(sdk.Unavailable, match="still down"):
            client.generate("x")
        assert len(server.servicer.requests) == 3
