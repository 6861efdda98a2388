"""Health that tells the truth: a target outage longer than the restart bound, and a stalled drafter.

Through a real gRPC server: health goes NOT_SERVING while the target is down and back to SERVING
when it returns; live requests fail with UNAVAILABLE after the bound (never hang), new ones are
refused at once; and a drafter that stops answering without closing its stream leaves pearl
requests finishing target-only with the exact output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duospec.cluster.actors import actor_name
from duospec.cluster.runtime import NAMESPACE
from duospec.coordinator.config import ServerSettings
from duospec.v1 import generation_pb2 as pb
from pipeline_support import model_config
from server_support import collect, running_server

SETTINGS = ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=0)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def _health(h) -> int:
    stub = health_pb2_grpc.HealthStub(h.channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service="duospec.v1.GenerationService"))).status


async def _wait_health(h, status: int, timeout: float = 30.0) -> float:
    start = time.monotonic()
    while await _health(h) != status:
        assert time.monotonic() - start < timeout, f"health did not become {status}"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


def _greedy_request(prompt_ids, n, mode=pb.SPECULATION_MODE_PEARL) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt_ids),
                              stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True),
                              speculation=pb.SpeculationParams(mode=mode))


@pytest.mark.ray
async def test_health_follows_a_target_outage_longer_than_the_restart_bound(ray_runtime, tmp_path):
    from duospec.coordinator.pipeline import start_pipeline
    from tiny_models import make_tiny_checkpoint

    target = make_tiny_checkpoint(tmp_path / "target", "llama", seed=31)
    draft = make_tiny_checkpoint(tmp_path / "draft", "llama", seed=32, hidden_size=32, num_layers=1)
    config = model_config("outage", target, draft)
    config = dataclasses.replace(config, restart_timeout_s=1.0)
    coordinator = start_pipeline([config])
    async with running_server(coordinator, SETTINGS) as h:
        baseline = await collect(h.stub, _greedy_request([5, 6, 7], 24))
        expected = [t for m in baseline for t in m.token_ids]
        scheduler = coordinator.entries["outage"].scheduler
        # The restarted actor is up in seconds; hold the coordinator's reconnection back until the test
        # says so, for an outage longer than the bound whatever the machine's speed.
        gate, reconnect = asyncio.Event(), scheduler.supervisor.reconnect_target

        async def gated_reconnect(loss):
            if not gate.is_set():
                await asyncio.sleep(1.0)  # the bound: restart_timeout_s
                raise ConnectionError("still restarting")
            return await reconnect(loss)

        scheduler.supervisor.reconnect_target = gated_reconnect
        live = h.stub.Generate(_greedy_request([9, 10, 11], 200), timeout=60)
        # its first tokens: the request is on the target when it goes (not a fixed sleep, which a fast
        # machine could outrun by finishing all 200)
        await live.read()
        ray_runtime.kill(ray_runtime.get_actor(actor_name("target", "outage"), namespace=NAMESPACE),
                         no_restart=False)
        await _wait_health(h, NOT_SERVING, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            while await live.read() != grpc.aio.EOF:  # UNAVAILABLE after the bound, not at the deadline
                pass
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(h.stub, _greedy_request([5, 6, 7], 4), timeout=20)
        # refused at once (typically ms; 10 s is generous for a loaded CI machine), not at the 20 s deadline
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 10.0
        await asyncio.sleep(1.5)  # past the bound: the old code gave up for good here
        assert await _health(h) == NOT_SERVING
        gate.set()
        await _wait_health(h, SERVING, timeout=60)
        again = await collect(h.stub, _greedy_request([5, 6, 7], 24))
        assert [t for m in again for t in m.token_ids] == expected
        assert (await coordinator.stats())["models"]["outage"]["target"]["restarts"] >= 1
    await coordinator.close()


async def test_a_stalled_drafter_leaves_pearl_requests_finishing_target_only(tiny_pair, monkeypatch):
    """The drafter's thread hangs in a step and its stream stays open: past the stall bound the
    sequences continue target-only, with the output of mode off."""
    from duospec.coordinator.local import LocalCoordinator
    from duospec.draft_worker.drafter import Drafter

    target, draft = tiny_pair
    release, steps = threading.Event(), [0]
    real_step = Drafter.step

    def step_then_hang(self):
        steps[0] += 1
        if steps[0] > 3:
            release.wait(60)  # stalled: no chunk, no error, the stream open
        return real_step(self)

    coordinator = LocalCoordinator([model_config("tiny", target, draft)])
    try:
        async with running_server(coordinator, SETTINGS) as h:
            off = await collect(h.stub, _greedy_request([5, 6, 7], 30, pb.SPECULATION_MODE_OFF))
            monkeypatch.setattr(Drafter, "step", step_then_hang)
            started = time.monotonic()
            pearl = await collect(h.stub, _greedy_request([5, 6, 7], 30), timeout=30)
            waited = time.monotonic() - started
            assert [t for m in pearl for t in m.token_ids] == [t for m in off for t in m.token_ids]
            assert steps[0] > 3  # the drafter did hang
            scheduler = coordinator.entries["tiny"].scheduler
            assert waited < scheduler.supervisor.draft_stall_bound_s() + 10
    finally:
        release.set()
