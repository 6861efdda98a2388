"""models[].replicas: independent pairs of one model behind one name. Each request goes to the serving
replica with the least outstanding work; health is SERVING while any replica serves; a replica whose
target dies gets no new requests while its live ones recover, and the other's streams go on."""

from __future__ import annotations

import asyncio
import collections
import dataclasses

import pytest

from duospec.coordinator.config import ServerSettings
from duospec.coordinator.replicas import LeastOutstandingWork, ReplicaState
from duospec.v1 import generation_pb2 as pb
from pipeline_support import model_config
from test_server_support import collect, running_server, tiny_pair  # noqa: F401  (fixture)

SETTINGS = ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=0)
MODES = (pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_PEARL, pb.SPECULATION_MODE_VANILLA)


class RecordingPolicy(LeastOutstandingWork):
    """The default routing, remembering where each request went."""

    def __init__(self):
        self.chosen: dict[str, int] = {}

    def choose(self, replicas, request):
        replica = super().choose(replicas, request)
        self.chosen[request.request_id] = replica.index
        return replica


def _request(prompt, n, mode) -> pb.GenerateRequest:
    return pb.GenerateRequest(model="tiny", prompt_token_ids=pb.TokenIds(ids=prompt),
                              stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True),
                              speculation=pb.SpeculationParams(mode=mode))


def _prompts(n: int) -> list[list[int]]:
    return [[5 + i, 17 + 3 * i, 40 + i, 9] for i in range(n)]


async def test_concurrent_streams_spread_over_the_replicas_with_the_output_of_one_pair(tiny_pair):  # noqa: F811
    from duospec.coordinator.local import LocalCoordinator

    target, draft = tiny_pair
    config = dataclasses.replace(model_config("tiny", target, draft), replicas=2)
    coordinator = LocalCoordinator([config])
    policy = coordinator.entries["tiny"].replicas.policy = RecordingPolicy()
    prompts = _prompts(16)
    async with running_server(coordinator, SETTINGS) as h:
        # the same requests one at a time on one replica: what each must produce
        want = [await _tokens(h, _request(p, 20, pb.SPECULATION_MODE_OFF)) for p in prompts]
        policy.chosen.clear()
        streams = [_tokens(h, _request(p, 20, MODES[i % 3])) for i, p in enumerate(prompts)]
        assert await asyncio.gather(*streams) == want
        assert collections.Counter(policy.chosen.values()) == {0: 8, 1: 8}
        stats = (await coordinator.stats())["models"]["tiny"]
        assert set(stats["replicas"]) == {"0", "1"} and stats["live_sequences"] == 0
        assert all(r["target"]["batches"] > 0 and r["outstanding_tokens"] == 0 for r in stats["replicas"].values())
        states = coordinator.replica_status("tiny")
        assert [(s.index, s.state, s.live_sequences) for s in states] == [(0, ReplicaState.SERVING, 0),
                                                                          (1, ReplicaState.SERVING, 0)]


async def _tokens(h, req, timeout=120) -> list[int]:
    return [t for m in await collect(h.stub, req, timeout=timeout) for t in m.token_ids]


def test_routing_prefers_the_least_outstanding_work_of_the_serving_replicas():
    from duospec.coordinator.replicas import ReplicaSet

    class Scheduler:  # what the routing reads of a scheduler
        def __init__(self, serving):
            self.target_serving, self.info = serving, type("Info", (), {"has_draft": False})()

    replicas = ReplicaSet()
    for _ in range(3):
        replicas.add(None)
    a, b, c = replicas.replicas
    for replica, serving in ((a, True), (b, True), (c, False)):
        replica.scheduler = Scheduler(serving)
    a.tokens_left, b.tokens_left, c.tokens_left = 100, 40, 0
    policy = LeastOutstandingWork()
    assert policy.choose(replicas.replicas, None) is b  # c has no work, but its target is down
    b.tokens_left = 100
    a.live, b.live = 3, 2
    assert policy.choose(replicas.replicas, None) is b  # equal tokens: fewer live requests
    a.scheduler.target_serving = b.scheduler.target_serving = False
    assert policy.choose(replicas.replicas, None) is c  # none serving: the least loaded, which says UNAVAILABLE
    assert not replicas.serving
    c.scheduler.target_serving = True
    assert replicas.serving and c.state is ReplicaState.SERVING and a.state is ReplicaState.DOWN
