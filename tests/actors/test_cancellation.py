"""Client cancel and deadline mid-stream free the sequence's KV slots on BOTH workers (promptly: a
leaked slot is never freed, so the bound is generous for a loaded CI machine; typically it takes ms).

Checked through `coordinator.worker_stats()` (what each worker itself holds), not the coordinator's
own bookkeeping: the point is that the draft and target really dropped the sequence's slots.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from duospec.coordinator.config import ModelConfig, ServerSettings
from duospec.v1 import generation_pb2 as pb
from server_support import MODEL, request, running_server, server_coordinator, wait_until_nothing_held

FREE_WITHIN_S = 10.0  # generous: workers release asynchronously (Ray polls); a real leak never frees
LONG = 230  # new tokens: long enough that the stream is still running when we cut it


def long_request(mode: int = pb.SPECULATION_MODE_PEARL) -> pb.GenerateRequest:
    req = request("def f(x):", LONG, speculation=pb.SpeculationParams(mode=mode))
    req.stopping.ignore_eos = True
    return req


async def worker_counts(coordinator, model: str) -> dict[str, tuple[int, int]]:
    """{role: (live_sequences, free_slots)} as each worker reports it."""
    stats = (await coordinator.worker_stats())[model]
    return {role: (s["live_sequences"], s["free_slots"]) for role, s in stats.items()}


async def idle_baseline(coordinator, model: str) -> dict[str, tuple[int, int]]:
    """Worker counts once no worker holds a sequence (a finished one is dropped asynchronously)."""
    deadline = time.monotonic() + 10.0
    while True:
        counts = await worker_counts(coordinator, model)
        if all(live == 0 for live, _ in counts.values()):
            return counts
        assert time.monotonic() < deadline, f"workers never went idle: {counts}"
        await asyncio.sleep(0.01)


async def wait_until_idle(coordinator, model: str, baseline: dict[str, tuple[int, int]], within: float) -> float:
    """Seconds until every worker is back to `baseline` (no live sequence, all slots free); fails after `within`."""
    t0 = time.monotonic()
    while True:
        counts = await worker_counts(coordinator, model)
        if counts == baseline:
            return time.monotonic() - t0
        if time.monotonic() - t0 > within:
            raise AssertionError(f"workers still hold the sequence {within:.1f} s later: {counts} (idle: {baseline})")
        await asyncio.sleep(0.01)


async def assert_held_by(coordinator, model: str, roles: tuple[str, ...]) -> None:
    """The in-flight sequence is live on each of `roles` (so freeing it later is a real observation)."""
    deadline = time.monotonic() + 10.0
    while True:
        counts = await worker_counts(coordinator, model)
        if all(counts[r][0] >= 1 for r in roles):
            return
        assert time.monotonic() < deadline, f"sequence never reached the workers {roles}: {counts}"
        await asyncio.sleep(0.01)


async def warm_up(h) -> None:
    """One short request: opens the model's scheduler (and its worker streams) so a baseline exists."""
    warm = request("a", 4)
    [m async for m in h.stub.Generate(warm, timeout=120)]


async def cancel_mid_stream(h, model: str, mode: int, roles: tuple[str, ...]) -> float:
    baseline = await idle_baseline(h.coordinator, model)
    call = h.stub.Generate(long_request(mode))
    first = await call.read()
    assert first.token_ids
    await assert_held_by(h.coordinator, model, roles)
    call.cancel()
    return await wait_until_idle(h.coordinator, model, baseline, FREE_WITHIN_S)


async def deadline_mid_stream(h, model: str) -> float:
    """A deadline that lands after the first tokens and before the end. The timeout is set from a
    timed full run (generation speed varies with the machine's load) and re-aimed if it misses."""
    t0 = time.monotonic()
    [m async for m in h.stub.Generate(long_request(), timeout=120)]
    timeout_s = (time.monotonic() - t0) / 2
    baseline = await idle_baseline(h.coordinator, model)
    for _ in range(6):
        got = []
        try:
            async for m in h.stub.Generate(long_request(), timeout=timeout_s):
                got.append(m)
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
            if got:  # mid-stream: what we came for
                assert sum(len(m.token_ids) for m in got) < LONG
                return await wait_until_idle(h.coordinator, model, baseline, FREE_WITHIN_S)
            timeout_s *= 1.5  # expired before the first token
            continue
        timeout_s /= 2  # the whole stream fit inside the deadline
    raise AssertionError(f"could not place a deadline mid-stream (last timeout {timeout_s:.3f} s)")


@pytest.fixture
async def harness(tiny_pair):
    async with running_server(server_coordinator(tiny_pair)) as h:
        await warm_up(h)
        yield h


@pytest.mark.parametrize("mode, roles", [
    (pb.SPECULATION_MODE_PEARL, ("target", "draft")),
    (pb.SPECULATION_MODE_VANILLA, ("target", "draft")),
    (pb.SPECULATION_MODE_OFF, ("target",)),
])
async def test_client_cancel_frees_slots_on_both_workers(harness, mode, roles):
    await cancel_mid_stream(harness, MODEL, mode, roles)


async def test_deadline_frees_slots_on_both_workers(harness):
    await deadline_mid_stream(harness, MODEL)


async def test_cancel_while_queued_for_a_slot_leaks_nothing(tiny_pair):
    settings = ServerSettings(port=0, metrics_port=0, http_port=0, max_concurrent_requests=1, max_queued_requests=4)
    async with running_server(server_coordinator(tiny_pair), settings) as h:
        await warm_up(h)
        baseline = await idle_baseline(h.coordinator, MODEL)
        running = h.stub.Generate(long_request())
        await running.read()
        queued = h.stub.Generate(long_request())
        for queued_now in (True, False):  # it queues behind the running one; cancelled, it leaves the queue
            deadline = time.monotonic() + FREE_WITHIN_S
            while (h.server.admission.waiting > 0) != queued_now:
                assert time.monotonic() < deadline, f"admission.waiting stayed {h.server.admission.waiting}"
                await asyncio.sleep(0.01)
            if queued_now:
                queued.cancel()
        running.cancel()
        await wait_until_idle(h.coordinator, MODEL, baseline, FREE_WITHIN_S)
        await wait_until_nothing_held(h.server, h.coordinator, MODEL)


@pytest.mark.ray
async def test_ray_pipeline_cancel_and_deadline_free_both_actors(ray_runtime, tiny_pair):
    from duospec.coordinator.pipeline import start_pipeline

    target, draft = tiny_pair
    model = "cancel-tiny"
    coordinator = start_pipeline([ModelConfig(name=model, target=str(target), draft=str(draft), device="cpu")])
    try:
        async with running_server(coordinator) as h:
            await warm_up(h)
            cancel_s = await cancel_mid_stream(h, model, pb.SPECULATION_MODE_PEARL, ("target", "draft"))
            deadline_s = await deadline_mid_stream(h, model)
            print(f"\nray pipeline: slots free {cancel_s * 1000:.0f} ms after cancel, "
                  f"{deadline_s * 1000:.0f} ms after deadline")
    finally:
        await coordinator.close()  # idempotent after the server's shutdown; removes the named actors
