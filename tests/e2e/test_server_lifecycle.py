"""Shutdown: drain within the grace period, then CANCELLED; new requests UNAVAILABLE; health NOT_SERVING."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duospec.coordinator.config import ServerSettings
from duospec.coordinator.serving.server import DuospecServer
from duospec.coordinator.serving.metrics import live_sequences
from duospec.v1 import generation_pb2 as pb
from duospec.v1 import generation_pb2_grpc as pb_grpc
from server_support import request, server_coordinator


async def _start(tiny_pair, delay):
    coordinator = server_coordinator(tiny_pair, step_delay_s=delay)
    server = DuospecServer(coordinator, ServerSettings(port=0, metrics_port=0, http_port=0), health_poll_s=0.05)
    port = await server.start()
    await server.wait_ready(30)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    return server, channel, pb_grpc.GenerationServiceStub(channel)


async def test_shutdown_drains_short_streams_and_cancels_long_ones(tiny_pair):
    """Grace 2 s: a 10-token stream finishes inside it; a 250-token one in mode off needs at least
    250 target forwards of 0.05 s (12.5 s) on any machine, so the grace period's end must cut it."""
    delay, grace = 0.05, 2.0
    server, channel, stub = await _start(tiny_pair, delay)
    short = request("a = ", 10)
    long = request("b = ", 250, speculation=pb.SpeculationParams(mode=pb.SPECULATION_MODE_OFF))
    short.stopping.ignore_eos = long.stopping.ignore_eos = True
    short_call, long_call = stub.Generate(short), stub.Generate(long)
    await short_call.read()
    await long_call.read()
    shutdown = asyncio.ensure_future(server.shutdown(grace_period_s=grace))
    await asyncio.sleep(0.1)
    health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        [m async for m in stub.Generate(request("c", 2))]
        raise AssertionError("a new request was accepted while draining")
    except grpc.aio.AioRpcError as err:
        assert err.code() == grpc.StatusCode.UNAVAILABLE
    short_rest = [m async for m in _rest(short_call)]
    long_rest = [m async for m in _rest(long_call)]
    await shutdown
    assert short_rest[-1].finish_reason == pb.FINISH_REASON_LENGTH  # finished inside the grace period
    final = long_rest[-1]
    assert final.finish_reason == pb.FINISH_REASON_CANCELLED, final
    assert 0 < final.usage.completion_tokens < 250
    assert live_sequences(await server.coordinator.stats()) == 0
    await channel.close()


async def _rest(call):
    while (m := await call.read()) is not grpc.aio.EOF:
        yield m
