"""Finding a hung worker, with fake links and a fake actor (no models, no Ray): a verify outstanding
far past its predicted cost loses the target as HUNG (health and new requests see it at once, the
live request resumes on the replacement); a stalled drafter's link is lost as SILENT; and the
pipeline's reconnection kills a hung actor, or a silent one that does not answer, but not one that
does. The whole path through real actors whose processes are stopped: tests/actors/test_worker_hangs.py."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest

from duospec.coordinator.scheduling import recovery
from duospec.coordinator.api import FinishEvent, ModelInfo, SpeculationMode, TokensEvent, Unavailable
from duospec.coordinator.scheduling.links import LinkLoss, loss_of
from duospec.coordinator.scheduling.policies import SpeculationPolicy
from duospec.coordinator.scheduling.scheduler import Scheduler, SchedulerConfig
from duospec.internal.v1 import pearl_pb2 as pb
from test_scheduler import _request

INFO = ModelInfo(name="m", target_path="t", draft_path="d", vocab_size=100, max_context=256, eos_token_id=None)
OFF = SpeculationPolicy(mode=SpeculationMode.OFF, max_draft_tokens=4, max_lookahead=8, adaptive=False)
PEARL = SpeculationPolicy(mode=SpeculationMode.PEARL, max_draft_tokens=4, max_lookahead=8, adaptive=False)


class SilentLink:
    """A worker that takes every message and never answers (its process stopped); closing it ends
    its stream."""

    def __init__(self):
        self.sent, self.closed = [], asyncio.Event()

    def send(self, message):
        self.sent.append(message)

    async def responses(self):
        await self.closed.wait()
        return
        yield

    async def close(self):
        self.closed.set()


class AnsweringTarget(SilentLink):
    """A target that answers every verify at once with the token `next_token(position)` (mode off)."""

    def __init__(self):
        super().__init__()
        self.inbox: asyncio.Queue = asyncio.Queue()

    def send(self, message):
        super().send(message)
        self.inbox.put_nowait(pb.VerdictBatch(batch_id=message.batch_id, verdicts=[
            pb.Verdict(seq_id=item.seq_id, epoch=item.epoch, kind=pb.NEXT_TOKEN_KIND_BONUS,
                       next_token=next_token(item.start_pos + len(item.context)))
            for item in message.items]))

    async def responses(self):
        while True:
            yield await self.inbox.get()


def next_token(position: int) -> int:
    return 10 + position % 50


async def _collect(scheduler, policy, n=6):
    tokens = []
    async for event in scheduler.generate(_request(n=n), policy):
        if isinstance(event, TokensEvent):
            tokens.extend(event.token_ids)
        assert isinstance(event, (TokensEvent, FinishEvent))
    return tokens


async def _until(condition, timeout=5.0):
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


async def test_a_verify_far_past_its_cost_loses_the_target_as_hung_and_the_request_resumes_on_its_replacement():
    hung, replacement, losses, released = SilentLink(), AnsweringTarget(), [], asyncio.Event()

    async def reconnect(loss):
        losses.append(loss)
        await released.wait()  # Ray restarting the killed target
        return replacement

    scheduler = Scheduler(INFO, hung, None, SchedulerConfig(hang_timeout_s=0.3), reconnect_target=reconnect)
    await scheduler.start()
    try:
        live = asyncio.ensure_future(_collect(scheduler, OFF))
        await _until(lambda: hung.sent)
        assert scheduler.target_serving
        await _until(lambda: not scheduler.target_serving)  # health goes NOT_SERVING
        await _until(lambda: losses)
        assert losses == [LinkLoss.HUNG] and hung.closed.is_set() and not live.done()
        with pytest.raises(Unavailable):  # refused at once while the target is being replaced
            await _collect(scheduler, OFF)
        released.set()
        tokens = await asyncio.wait_for(live, 5)  # re-prefilled on the replacement, then finished
        assert tokens == [next_token(p) for p in range(3, 9)]
        assert replacement.sent[0].items[0].start_pos == 0 and scheduler.target_serving
    finally:
        await scheduler.close()


async def test_the_hang_bound_follows_the_measured_verify_cost_above_its_floor():
    scheduler = Scheduler(INFO, SilentLink(), None, SchedulerConfig(hang_timeout_s=10.0))
    inflight = type("Inflight", (), {"n_tokens": 200})()
    assert scheduler.supervisor.verify_hang_bound_s(inflight) == 10.0  # nothing measured: the floor
    for n in (4, 8, 4, 8, 4, 8):  # 0.1 s + 0.05 s per token
        scheduler.verify_cost.observe(n, 0.1 + 0.05 * n)
    assert scheduler.supervisor.verify_hang_bound_s(inflight) == pytest.approx(recovery.VERIFY_HANG_FACTOR * 10.1)


async def test_a_stalled_drafter_is_lost_as_silent_and_its_request_finishes_target_only(monkeypatch):
    monkeypatch.setattr(recovery, "DRAFT_STALL_FLOOR_S", 0.3)
    draft, losses = SilentLink(), []

    async def reconnect_draft(loss):
        losses.append(loss)
        await asyncio.Event().wait()  # still restarting for the rest of the test

    scheduler = Scheduler(INFO, AnsweringTarget(), draft, SchedulerConfig(hang_timeout_s=0.3),
                          reconnect_draft=reconnect_draft)
    await scheduler.start()
    try:
        tokens = await asyncio.wait_for(_collect(scheduler, PEARL), 5)
        assert tokens == [next_token(p) for p in range(3, 9)] and losses == [LinkLoss.SILENT]
    finally:
        await scheduler.close()


def test_unanswered_keepalive_pings_read_as_a_hang():
    def error(code, details):
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    assert loss_of(error(grpc.StatusCode.UNAVAILABLE, "Stream removed (ping timeout)")) is LinkLoss.HUNG
    assert loss_of(error(grpc.StatusCode.UNAVAILABLE, "keepalive watchdog timeout")) is LinkLoss.HUNG
    assert loss_of(error(grpc.StatusCode.UNAVAILABLE, "Socket closed")) is LinkLoss.CLOSED  # a crash
    assert loss_of(ConnectionError("reset")) is LinkLoss.CLOSED


class FakeActor:
    """An actor handle whose process answers `info` (or not, while stopped); `ray.kill` replaces it."""

    _starts = itertools.count(1)

    def __init__(self, endpoint, answering=True):
        self.endpoint, self.answering, self.kills = endpoint, answering, 0
        self.started_at = next(self._starts)
        self.info = self

    def remote(self):
        future = asyncio.get_running_loop().create_future()
        if self.answering:
            future.set_result({"endpoint": self.endpoint, "started_at": self.started_at, "pid": self.started_at})
        return future

    def killed(self):  # Ray restarts it: a new process that answers
        self.kills += 1
        self.answering, self.started_at = True, next(self._starts)


@pytest.mark.parametrize("loss, answering, killed", [
    (LinkLoss.CLOSED, True, False),  # it died: Ray restarts it, nothing to kill
    (LinkLoss.SILENT, True, False),  # stalled but answers: reconnect to it as it is
    (LinkLoss.SILENT, False, True),  # stalled and silent: replace it
    (LinkLoss.HUNG, True, True),  # hung (a verify long past its cost, no keepalive): replace it at once
])
async def test_the_reconnection_kills_only_an_actor_that_does_not_answer(monkeypatch, loss, answering, killed):
    import ray

    from duospec.cluster.actors import WorkerPair
    from duospec.coordinator import pipeline

    server = grpc.aio.server()  # an endpoint the new link can reach
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    actor = FakeActor(f"127.0.0.1:{port}", answering)
    first = actor.started_at
    pair = WorkerPair("m", actor, None, None, {"started_at": first}, None, "secret")
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart: handle.killed())
    try:
        link = await asyncio.wait_for(pipeline._reconnector(pair, "target", 10.0, 0.3)(loss), 10)
        await link.close()
        assert actor.kills == int(killed)
        assert (pair.target_info["started_at"] != first) == killed  # connected to the replacement, if any
    finally:
        await server.stop(0)


def test_hang_timeout_is_a_validated_model_setting():
    from duospec.coordinator.config import ConfigError, ModelConfig, parse_serve_config

    def parsed(**fields):
        return parse_serve_config({"models": [{"name": "m", "target": "t", **fields}]}).models[0]

    assert parsed().hang_timeout_s == ModelConfig.hang_timeout_s
    assert parsed(hang_timeout_s=30).hang_timeout_s == 30.0
    with pytest.raises(ConfigError, match=r"models\[0\]\.hang_timeout_s: 0\.1 is out of range"):
        parsed(hang_timeout_s=0.1)
