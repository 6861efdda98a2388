"""A worker that hangs without closing its streams — its process SIGSTOPped, as a hung GPU or a node
that stops answering would leave it — through a real gRPC server on real Ray actors.

The target: health leaves SERVING within the hang bound, a new request is refused with UNAVAILABLE
at once, the live one finishes exactly once Ray has replaced the target (or ends UNAVAILABLE, never at
its deadline), and the server serves again. The drafter: the live pearl request finishes target-only
with the output of mode off, and the replaced drafter speculates for later requests. A stopped
process is always continued (or killed) before the test ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time

import grpc
import pytest

from duospec.cluster.actors import actor_name
from duospec.cluster.runtime import NAMESPACE
from duospec.coordinator.config import ServerSettings
from duospec.v1 import generation_pb2 as pb
from exactness import assert_greedy_equal, reference_model
from pipeline_support import BackgroundLoop, model_config
from test_health import NOT_SERVING, SERVING, _greedy_request, _health, _wait_health
from server_support import collect, running_server
from tiny_models import make_tiny_checkpoint

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "hang"
HANG_S = 2.0  # the model's hang_timeout_s here: a stopped worker is found within seconds
N_NEW = 300  # long enough that the stream is still running when its worker is stopped
DEADLINE_S = 150.0  # every call's deadline: a request that waited on a stopped worker would meet it


@pytest.fixture(scope="module")
def served(ray_runtime, tmp_path_factory):
    from duospec.coordinator.pipeline import start_pipeline

    root = tmp_path_factory.mktemp("hang")
    target = make_tiny_checkpoint(root / "target", "llama", seed=51)
    draft = make_tiny_checkpoint(root / "draft", "llama", seed=51, init_std=0.021)  # agrees often
    config = dataclasses.replace(model_config(MODEL, target, draft), hang_timeout_s=HANG_S, restart_timeout_s=120.0)
    loop = BackgroundLoop()
    coordinator = start_pipeline([config])
    server = running_server(coordinator, ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=0))
    h = loop.run(server.__aenter__())
    hf = reference_model(str(target))
    try:
        yield h, loop, hf
    finally:
        loop.run(server.__aexit__(None, None, None))  # shuts the server and the coordinator (its actors) down
        loop.close()


def _pid(ray, role: str) -> int:
    return ray.get(ray.get_actor(actor_name(role, MODEL), namespace=NAMESPACE).info.remote(), timeout=60)["pid"]


@contextlib.contextmanager
def _stopped(pid: int):
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):  # (Ray killed it)
            os.kill(pid, signal.SIGCONT)


async def _rest(call) -> list:
    """The messages of a stream that was started with `read()` (gRPC does not mix it with iteration)."""
    out = []
    while (message := await call.read()) is not grpc.aio.EOF:
        out.append(message)
    return out


def _tokens(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]


async def _off(h, prompt, n) -> list[int]:
    return _tokens(await collect(h.stub, _greedy_request(prompt, n, pb.SPECULATION_MODE_OFF), timeout=DEADLINE_S))


async def _replaced(ray, role: str, old_pid: int, coordinator, timeout_s: float = 120.0) -> int:
    """The new pid, once Ray has restarted the role's actor and the coordinator reconnected to it."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = (await coordinator.stats())["models"][MODEL][role]
        if stats["connected"] and stats["restarts"] >= 1:
            pid = await asyncio.to_thread(_pid, ray, role)
            if pid != old_pid:
                return pid
        assert time.monotonic() < deadline, f"the {role} was not replaced: {stats}"
        await asyncio.sleep(0.2)


def test_a_stopped_target_is_replaced_and_no_request_waits_for_it(served, ray_runtime):
    h, loop, hf = served
    live_prompt, new_prompt = [9, 10, 11], [5, 6, 7]

    async def scenario():
        want_live, want_new = await _off(h, live_prompt, N_NEW), await _off(h, new_prompt, 16)
        pid = await asyncio.to_thread(_pid, ray_runtime, "target")
        live = h.stub.Generate(_greedy_request(live_prompt, N_NEW), timeout=DEADLINE_S)
        first = await live.read()
        assert not first.finish_reason
        with _stopped(pid):
            stopped_at = time.monotonic()
            await _wait_health(h, NOT_SERVING, timeout=HANG_S + 15)  # hang bound, keepalive, health poll
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(h.stub, _greedy_request(new_prompt, 4), timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 5.0
            try:  # the live request waits for the replaced target and finishes exactly, or fails fast
                rest = await _rest(live)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            else:
                assert_greedy_equal(hf, live_prompt, _tokens([first, *rest]), want_live)
            new_pid = await _replaced(ray_runtime, "target", pid, h.coordinator)
            await _wait_health(h, SERVING, timeout=60)
        assert new_pid != pid and time.monotonic() - stopped_at < DEADLINE_S
        again = await collect(h.stub, _greedy_request(new_prompt, 16), timeout=DEADLINE_S)
        assert _tokens(again) == want_new

    loop.run(scenario(), timeout=DEADLINE_S + 60)


def test_a_stopped_drafter_leaves_requests_finishing_target_only_and_is_replaced(served, ray_runtime):
    h, loop, hf = served
    prompt = [12, 13, 14, 15]

    async def scenario():
        want = await _off(h, prompt, N_NEW)
        pid = await asyncio.to_thread(_pid, ray_runtime, "draft")
        live = h.stub.Generate(_greedy_request(prompt, N_NEW), timeout=DEADLINE_S)
        first = await live.read()
        assert not first.finish_reason
        with _stopped(pid):
            rest = await _rest(live)  # target-only once the drafter is found silent
            assert_greedy_equal(hf, prompt, _tokens([first, *rest]), want)
            assert await _health(h) == SERVING  # a lost drafter costs speed, not service
            new_pid = await _replaced(ray_runtime, "draft", pid, h.coordinator)
        assert new_pid != pid
        later = await collect(h.stub, _greedy_request(prompt, 24), timeout=DEADLINE_S)
        assert _tokens(later) == want[:24] and later[-1].stats.drafted_tokens > 0  # speculating again

    loop.run(scenario(), timeout=DEADLINE_S + 60)
