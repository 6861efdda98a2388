"""One replica's scheduler as a Ray actor, for a front that scales out (server.gateways > 1, or gateways
on other nodes: coordinator/remote.py is their side).

The actor owns what is per replica: the PEARL loop (coordinator/scheduling/scheduler.py), its links
to the replica's draft and target workers and the reconnectors that follow Ray's restarts of them, the
fair share between the tenants routed to it and its KV admission. It is a coordinator of one replica
(a ModelRouter with one model of one replica), so requests are validated and turned into speculation
policies here exactly as in the one-process server.

Gateways reach it over the internal data plane, as the scheduler reaches the workers: a gRPC
server on the actor's node whose calls must carry the deployment secret (and, with
server.internal_tls, mutual TLS). One method, `SchedulerService/Serve`: one bidirectional stream per
gateway, carrying all of that gateway's requests, batched as the worker links are — the gateway sends
`[(START, call id, GenerationRequest) | (CANCEL, call id, None), ...]`, the scheduler answers with
`[(call id, TokensEvent | FinishEvent | CoordinatorError), ...]`, everything its sequences produced
in one turn of its event loop (a verify round's events for every sequence of that gateway) in one
message. The messages are the coordinator's own frozen dataclasses, pickled: both ends are one
duospec version of one deployment, the peer is authenticated before a byte is deserialized (the
interceptor answers a call without the secret before its first message is read), and a proto mirror
of every request field would be a second definition of each to keep in step.

Load is published through Ray (`load()`, polled by every gateway): the replica's state, live
requests and the tokens they may still produce, and its scheduler's stats. Ray restarts the actor
when it dies (max_restarts=-1); the new one opens its links again, and gateways find its new endpoint
through `info()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import time

import grpc

from duospec.cluster.keepalive import WORKER_KEEPALIVE_OPTIONS
from duospec.cluster.runtime import NAMESPACE, node_ip
from duospec.cluster.secret import DeploymentSecretAioInterceptor

log = logging.getLogger("duospec.scheduler_actor")

SERVICE = "duospec.internal.v1.SchedulerService"
SERVE = f"/{SERVICE}/Serve"
START, CANCEL = "start", "cancel"  # what a gateway asks of the scheduler, per call


def scheduler_name(model: str, replica: int) -> str:
    """The Ray actor name (namespace "duospec") of a model's replica's scheduler."""
    return f"duospec-scheduler:{model}:{replica}"


def encode(message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


decode = pickle.loads


class SchedulerActor:
    """Ray actor (async): `launch_scheduler` creates it. `config`: the model's ModelConfig; `info`: its
    ModelInfo; `pair`: the replica's WorkerPair (its actor handles, endpoints, secret, TLS)."""

    def __init__(self, config, info, pair):
        from duospec.coordinator.pipeline import open_pair_scheduler
        from duospec.coordinator.scheduling.router import ModelEntry, ModelRouter

        self.started_at = time.time()
        self.replica = pair.replica
        self.pair = pair
        self.router = ModelRouter()

        def nodes() -> tuple[str, str]:
            return pair.target_info.get("node_id", ""), (pair.draft_info or {}).get("node_id", "")

        self.router.add_model(ModelEntry(info, config, lambda: open_pair_scheduler(config, info, pair), nodes))
        self.entry = self.router.entries[info.name]
        self.server: grpc.aio.Server | None = None
        self.endpoint = ""  # "" until `start`: a restarted actor is started again by the gateways' polls
        self._starting = asyncio.Lock()

    async def start(self) -> str:
        """Opens the replica's links and the gateways' endpoint; returns it. Called once by whoever
        created the actor, and again by a gateway after Ray restarted it (a no-op when started)."""
        async with self._starting:
            if self.server is None:
                await self._open_endpoint()
            await self.entry.get_scheduler()  # the links to the workers: fails here, not at the first request
        return self.endpoint

    async def _open_endpoint(self) -> None:
        server = grpc.aio.server(
            interceptors=[DeploymentSecretAioInterceptor(self.pair.deployment_secret)],
            options=[("grpc.max_receive_message_length", 64 << 20), *WORKER_KEEPALIVE_OPTIONS])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
            "Serve": grpc.stream_stream_rpc_method_handler(
                self._serve, request_deserializer=decode, response_serializer=encode)})])
        host = node_ip()
        tls = self.pair.internal_tls
        port = server.add_secure_port(f"{host}:0", tls.server_credentials()) if tls is not None \
            else server.add_insecure_port(f"{host}:0")
        await server.start()
        self.server, self.endpoint = server, f"{host}:{port}"

    async def _serve(self, commands, context):
        """One gateway's stream: runs each request it starts as a task of its own and sends back what
        they produced, one message per turn of the loop."""
        outbox: list[tuple[int, object]] = []
        ready = asyncio.Event()
        calls: dict[int, asyncio.Task] = {}

        async def run(call: int, request) -> None:
            from duospec.coordinator.api import CoordinatorError

            try:
                async with contextlib.aclosing(self.router.generate(request)) as events:
                    async for event in events:
                        outbox.append((call, event))
                        ready.set()
            except CoordinatorError as exc:  # the gateway raises it: its status and message reach the client
                outbox.append((call, exc))
                ready.set()
            finally:
                calls.pop(call, None)

        async def read() -> None:
            async for batch in commands:
                for kind, call, request in batch:
                    if kind == START:
                        calls[call] = asyncio.create_task(run(call, request))
                    elif call in calls:
                        calls.pop(call).cancel()  # closes the sequence's generator: frees its slots
            ready.set()

        reader = asyncio.create_task(read())
        try:
            while not (reader.done() and not calls and not outbox):
                await ready.wait()
                ready.clear()
                await asyncio.sleep(0)  # the other sequences woken by the same verdict add theirs first
                if outbox:
                    batch, outbox[:] = list(outbox), []
                    yield batch
            reader.result()  # a gateway that broke its stream: raise here, not silently
        finally:
            reader.cancel()
            for task in calls.values():
                task.cancel()

    def info(self) -> dict:
        import ray

        return {"endpoint": self.endpoint, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "started_at": self.started_at, "replica": self.replica}

    def load(self) -> dict:
        """What gateways route on: {state, serving, live, tokens_left, stats: the scheduler's stats}."""
        replica = self.entry.replicas.replicas[0]
        stats = self.entry.replicas.stats()  # one replica: its scheduler's stats
        status = replica.status(stats)
        return {"endpoint": self.endpoint if replica.scheduler is not None else "",
                "state": status.state.value, "serving": replica.serving, "live": replica.live,
                "tokens_left": replica.tokens_left, "target_restarts": status.target_restarts,
                "draft_restarts": status.draft_restarts, "target_node_id": status.target_node_id,
                "draft_node_id": status.draft_node_id, "started_at": self.started_at,
                "stats": stats}

    async def close(self) -> None:
        await self.router.close()
        if self.server is not None:
            await self.server.stop(1.0)


def launch_scheduler(config, info, pair, start_timeout_s: float = 120.0):
    """Creates the replica's scheduler actor on its target's node (soft: anywhere when that node is
    gone), named scheduler_name(model, replica), restarted by Ray when it dies; returns its handle once
    its links are open."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = pair.target_info.get("node_id")
    strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=True) if node else "DEFAULT"
    # num_cpus=0: it must not take a logical CPU the workers' placement counts on; its load is the
    # round's bookkeeping, light next to a forward
    handle = ray.remote(SchedulerActor).options(
        name=scheduler_name(info.name, pair.replica), namespace=NAMESPACE, num_cpus=0, max_restarts=-1,
        max_task_retries=0, max_concurrency=1000, scheduling_strategy=strategy,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    ).remote(config, info, pair)
    ray.get(handle.start.remote(), timeout=start_timeout_s)
    return handle

