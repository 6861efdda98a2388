"""Overload: 200 concurrent clients against a real in-process gRPC server over LocalCoordinator.

The admission cap (`server.max_concurrent_requests`) and bounded queue (`server.max_queued_requests`)
must turn the excess away at once with RESOURCE_EXHAUSTED, while every admitted stream completes, the
server keeps answering health checks, and its resident memory stays bounded.
"""

from __future__ import annotations

import asyncio
import os
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duospec.coordinator.config import ServerSettings, parse_serve_config
from duospec.v1 import generation_pb2 as pb
from server_support import request, running_server, server_coordinator, wait_until_nothing_held

CLIENTS = 200
MAX_CONCURRENT = 4
MAX_QUEUED = 16
NEW_TOKENS = 6
RSS_GROWTH_LIMIT_MB = 300  # 200 streams' buffers + gRPC call state; a leak per request would blow past it


def rss_mb(pid: int | str = "self") -> float:
    """Resident set size from /proc (no psutil dependency); 0.0 where /proc is missing."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class RssSampler:
    """Samples this process's RSS every `period_s` while running, keeping the peak."""

    def __init__(self, period_s: float = 0.05):
        self.period_s = period_s
        self.peak = rss_mb()
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            self.peak = max(self.peak, rss_mb())
            await asyncio.sleep(self.period_s)

    def __enter__(self) -> "RssSampler":
        self._task = asyncio.ensure_future(self._run())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()
        self.peak = max(self.peak, rss_mb())


async def _one_client(stub, i: int) -> tuple[str, list[pb.GenerateResponse], float]:
    """Returns (status name, messages, seconds until the first response or error)."""
    req = request(f"x{i} = ", NEW_TOKENS)
    req.stopping.ignore_eos = True
    t0 = time.monotonic()
    first_at = None
    messages = []
    try:
        async for m in stub.Generate(req, timeout=120):
            first_at = first_at or time.monotonic() - t0
            messages.append(m)
    except grpc.aio.AioRpcError as err:
        return err.code().name, messages, time.monotonic() - t0
    return "OK", messages, first_at


def test_queue_bounds_come_from_the_serve_config():
    config = parse_serve_config({"server": {"max_concurrent_requests": 3, "max_queued_requests": 0},
                                 "models": [{"name": "m", "target": "/t"}]})
    assert (config.server.max_concurrent_requests, config.server.max_queued_requests) == (3, 0)


async def test_200_concurrent_clients_get_served_or_resource_exhausted(tiny_pair):
    settings = ServerSettings(port=0, metrics_port=0, http_port=0, max_concurrent_requests=MAX_CONCURRENT,
                              max_queued_requests=MAX_QUEUED)
    coordinator = server_coordinator(tiny_pair)
    async with running_server(coordinator, settings) as h:
        await _one_client(h.stub, -1)  # warm up: open the scheduler, first forward passes
        rss_before = rss_mb()
        with RssSampler() as sampler:
            results = await asyncio.gather(*(_one_client(h.stub, i) for i in range(CLIENTS)))
            health = await health_pb2_grpc.HealthStub(h.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        rss_after = rss_mb()
        by_code: dict[str, int] = {}
        for code, _, _ in results:
            by_code[code] = by_code.get(code, 0) + 1
        print(f"\n200 clients: {by_code}; RSS before {rss_before:.0f} MB, peak {sampler.peak:.0f} MB, "
              f"after {rss_after:.0f} MB (pid {os.getpid()})")
        assert set(by_code) <= {"OK", "RESOURCE_EXHAUSTED"}, by_code
        assert by_code.get("OK", 0) >= MAX_CONCURRENT + MAX_QUEUED
        assert by_code.get("RESOURCE_EXHAUSTED", 0) > 0
        for code, messages, seconds in results:
            if code == "OK":
                assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
                assert sum(len(m.token_ids) for m in messages) == NEW_TOKENS
            else:
                # typically milliseconds; the bound is generous for a loaded 2-core CI machine
                assert seconds < 15.0, f"a rejection took {seconds:.1f} s: it should not wait for a slot"
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert sampler.peak - rss_before < RSS_GROWTH_LIMIT_MB
        await wait_until_nothing_held(h.server, coordinator, "tiny")
        # The server still serves normally after the burst.
        code, messages, _ = await _one_client(h.stub, CLIENTS)
        assert code == "OK" and messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
