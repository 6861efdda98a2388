"""models[].replicas: independent pairs of one model behind one name. Each request goes to the serving
replica with the least outstanding work; health is SERVING while any replica serves; a replica whose
target dies gets no new requests while its live ones recover, and the other's streams go on."""

from __future__ import annotations

import asyncio
import collections
import dataclasses

import pytest

from duospec.coordinator.config import ServerSettings
from duospec.coordinator.scheduling.replicas import ReplicaState
from duospec.coordinator.scheduling.routing import LeastOutstandingWork
from duospec.v1 import generation_pb2 as pb
from pipeline_support import model_config
from server_support import collect, running_server

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


async def test_concurrent_streams_spread_over_the_replicas_with_the_output_of_one_pair(tiny_pair):
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
        # least outstanding work balances tokens, not requests, and the first streams' tokens drain while
        # the later ones are routed: about half each, not exactly
        counts = collections.Counter(policy.chosen.values())
        assert sorted(counts) == [0, 1] and max(counts.values()) <= 10, counts
        stats = (await coordinator.stats())["models"]["tiny"]
        assert set(stats["replicas"]) == {"0", "1"} and stats["live_sequences"] == 0
        assert all(r["target"]["batches"] > 0 and r["outstanding_tokens"] == 0 for r in stats["replicas"].values())
        states = coordinator.replica_status("tiny")
        assert [(s.index, s.state, s.live_sequences) for s in states] == [(0, ReplicaState.SERVING, 0),
                                                                          (1, ReplicaState.SERVING, 0)]


async def test_admins_see_each_replicas_state_in_the_model_listing(tiny_pair):
    from duospec.coordinator.local import LocalCoordinator
    from duospec.coordinator.tenants.tenancy import Tenant, hash_api_key, new_api_key

    target, draft = tiny_pair
    keys = {"alpha": new_api_key(), "ops": new_api_key()}
    tenants = [Tenant("alpha", key_hashes=(hash_api_key(keys["alpha"]),)),
               Tenant("ops", key_hashes=(hash_api_key(keys["ops"]),), admin=True)]
    coordinator = LocalCoordinator([dataclasses.replace(model_config("tiny", target, draft), replicas=2)])
    async with running_server(coordinator, SETTINGS, tenants=tenants) as h:
        cards = {name: (await h.stub.ListModels(pb.ListModelsRequest(),
                                                metadata=(("authorization", f"Bearer {key}"),))).models[0]
                 for name, key in keys.items()}
    assert list(cards["alpha"].replicas) == []
    assert [(r.index, r.state, r.live_sequences) for r in cards["ops"].replicas] == [
        (0, pb.REPLICA_STATE_SERVING, 0), (1, pb.REPLICA_STATE_SERVING, 0)]


async def _tokens(h, req, timeout=120) -> list[int]:
    return [t for m in await collect(h.stub, req, timeout=timeout) for t in m.token_ids]


def test_routing_prefers_the_least_outstanding_work_of_the_serving_replicas():
    from duospec.coordinator.scheduling.replicas import ReplicaSet

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


def _serving_replicas(n: int):
    from duospec.coordinator.scheduling.replicas import ReplicaSet

    class Scheduler:  # what the routing reads of a scheduler
        def __init__(self):
            self.target_serving, self.info = True, type("Info", (), {"has_draft": False})()

    replicas = ReplicaSet()
    for _ in range(n):
        replicas.add(None).scheduler = Scheduler()
    return replicas.replicas


def _gen_request(prompt, tenant="default"):
    from duospec.coordinator.api import GenerationRequest

    return GenerationRequest(request_id="r", prompt_token_ids=tuple(prompt), max_new_tokens=8, tenant=tenant)


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica_while_the_load_allows():
    from duospec.coordinator.scheduling.routing import PrefixAffinity

    replicas = _serving_replicas(3)
    system, other = list(range(100, 148)), list(range(300, 348))  # three 16-token blocks each
    policy = PrefixAffinity(slack_tokens=100)

    def fresh(prompt, tenant="default"):  # what another gateway, which routed nothing yet, chooses
        return PrefixAffinity(slack_tokens=100).choose(replicas, _gen_request(prompt, tenant))

    # Nothing shared yet: the prompt's home replica, the same from every gateway.
    home = policy.choose(replicas, _gen_request(system + [1]))
    assert home is fresh(system + [2])
    rest = [r for r in replicas if r is not home]
    home.tokens_left = 60
    assert policy.choose(replicas, _gen_request(system + [2, 3])) is home  # shares 3 blocks with home's
    assert policy.choose(replicas, _gen_request(system[:20] + [9] * 30)) is home  # shares its first block
    assert policy.choose(replicas, _gen_request(other + [1])) is fresh(other + [1])  # shares nothing: its home
    assert policy.choose(replicas, _gen_request(list(range(100, 110)))) in rest  # under one block: least work
    home.tokens_left = 200  # over the least loaded by more than the slack: least work wins
    assert policy.choose(replicas, _gen_request(system + [5])) in rest
    moved = policy.choose(replicas, _gen_request(system + [5]))  # the prefix now lives there
    home.tokens_left, moved.tokens_left = 0, 500
    assert policy.choose(replicas, _gen_request(system + [6])) is not moved  # its replica is now too busy
    # Another tenant's prompt never shares a key with this one's (their caches are apart).
    assert PrefixAffinity.keys(_gen_request(system, "beta"))[0] != PrefixAffinity.keys(_gen_request(system))[0]
    owner = policy.choose(replicas, _gen_request(system + [7]))
    owner.scheduler.target_serving = False
    assert policy.choose(replicas, _gen_request(system + [8])) is not owner  # its replica is down


async def test_prefix_affinity_routes_a_shared_system_prompt_to_the_replica_that_cached_it(tiny_pair):
    from duospec.coordinator.local import LocalCoordinator
    from duospec.coordinator.scheduling.routing import PrefixAffinity

    class Recording(PrefixAffinity):
        def __init__(self):
            super().__init__()
            self.chosen: dict[tuple, set[int]] = {}

        def choose(self, replicas, request):
            replica = super().choose(replicas, request)
            self.chosen.setdefault(tuple(request.prompt_token_ids[:4]), set()).add(replica.index)
            return replica

    target, draft = tiny_pair
    config = dataclasses.replace(model_config("tiny", target, draft), replicas=2, routing="prefix_affinity")
    coordinator = LocalCoordinator([config])
    assert isinstance(coordinator.entries["tiny"].replicas.policy, PrefixAffinity)
    policy = coordinator.entries["tiny"].replicas.policy = Recording()
    systems = [[7 + (i * 5 + j * 11) % 200 for i in range(40)] for j in range(2)]  # two prompts of 2.5 blocks
    async with running_server(coordinator, SETTINGS) as h:
        # one request each first (together: the second goes where the first is not), so that each
        # system prompt is cached on a replica
        await asyncio.gather(*(_tokens(h, _request(system + [1], 12, pb.SPECULATION_MODE_PEARL)) for system in systems))
        requests = [(system, tail) for tail in (2, 3, 4) for system in systems]
        done = await asyncio.gather(*(collect(h.stub, _request(system + [tail], 12, pb.SPECULATION_MODE_PEARL))
                                      for system, tail in requests))
        one_at_a_time = [await _tokens(h, _request(system + [tail], 12, pb.SPECULATION_MODE_OFF))
                         for system, tail in requests]
    assert [[t for m in messages for t in m.token_ids] for messages in done] == one_at_a_time
    assert all(messages[-1].usage.cached_prompt_tokens >= 32 for messages in done)
    first, second = (policy.chosen[tuple(system[:4])] for system in systems)
    assert len(first) == len(second) == 1 and first != second  # each prompt on one replica, the two apart


@pytest.mark.ray
@pytest.mark.slow
async def test_a_replicas_target_killed_mid_stream_leaves_the_other_streaming_and_health_serving(
        ray_runtime, tiny_pair):
    import os
    import signal
    import time

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from duospec.coordinator.pipeline import start_pipeline
    from exactness import assert_greedy_equal, hf_greedy, reference_model

    target, draft = tiny_pair
    coordinator = start_pipeline([dataclasses.replace(model_config("tiny", target, draft), replicas=2)])
    policy = coordinator.entries["tiny"].replicas.policy = RecordingPolicy()
    hf = reference_model(str(target))
    prompts, n_new = _prompts(16), 160
    arrivals: dict[int, list[tuple[float, str]]] = collections.defaultdict(list)  # stream -> (time, request id)
    tokens: dict[int, list[int]] = collections.defaultdict(list)
    health: list[int] = []

    async def stream(h, i):
        async for message in h.stub.Generate(_request(prompts[i], n_new, MODES[i % 3]), timeout=240):
            arrivals[i].append((time.monotonic(), message.request_id))
            tokens[i].extend(message.token_ids)

    async def watch_health(h):
        stub = health_pb2_grpc.HealthStub(h.channel)
        while True:
            health.append((await stub.Check(health_pb2.HealthCheckRequest(service="duospec.v1.GenerationService"))).status)
            await asyncio.sleep(0.05)

    async with running_server(coordinator, SETTINGS) as h:  # (its shutdown closes the coordinator)
        watcher = asyncio.ensure_future(watch_health(h))
        streams = asyncio.gather(*(stream(h, i) for i in range(16)))
        deadline = time.monotonic() + 120
        while (await coordinator.stats())["models"]["tiny"]["replicas"]["1"].get("target", {}).get("batches", 0) < 5:
            assert time.monotonic() < deadline, "generation did not start"
            await asyncio.sleep(0.02)
        os.kill(coordinator.pairs["tiny#1"].target_info["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        while coordinator.replica_status("tiny")[1].state is not ReplicaState.DOWN:
            await asyncio.sleep(0.01)
        # a request arriving while replica 1 is down goes to replica 0, though replica 0 has more work
        extra = await collect(h.stub, _request(prompts[0], 4, pb.SPECULATION_MODE_OFF))
        assert policy.chosen[extra[0].request_id] == 0
        while coordinator.replica_status("tiny")[1].target_restarts < 1:
            await asyncio.sleep(0.05)
        back_at = time.monotonic()
        await streams
        watcher.cancel()
        status = coordinator.replica_status("tiny")
    replica_of = {i: policy.chosen[arrivals[i][0][1]] for i in range(16)}
    assert collections.Counter(replica_of.values()) == {0: 8, 1: 8}
    for i in range(16):
        assert len(tokens[i]) == n_new
        assert_greedy_equal(hf, prompts[i], tokens[i], hf_greedy(hf, prompts[i], n_new))
    # replica 0 was never disturbed, and its streams went on while replica 1's target was down
    assert status[0].target_restarts == 0 and status[1].target_restarts >= 1
    assert any(killed_at < t < back_at for i in range(16) if replica_of[i] == 0 for t, _ in arrivals[i]), \
        "no token reached replica 0's streams while replica 1 was down"
    assert set(health) == {health_pb2.HealthCheckResponse.SERVING}
