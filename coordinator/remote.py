"""A gateway's coordinator: the replicas' scheduler actors (cluster/scheduler_actor.py) of a deployment
already serving on Ray, reached over the internal data plane. What a gateway process serves through
(coordinator/serving/gateways.py); it implements coordinator.api.Coordinator, so the gateway, its
fronts and its tenancy do not know the schedulers are elsewhere.

    coordinator = await RemoteCoordinator.join()   # in a Ray driver of the deployment's cluster
    async for event in coordinator.generate(request): ...

Routing: each model's routing policy (coordinator/scheduling/routing.py) chooses among its replicas on
the load the schedulers publish (polled every LOAD_POLL_S), plus the requests this gateway sent
since that poll, so a burst between two polls is spread too, and two gateways see the same loads.

A scheduler lost under a request (its actor died: the stream breaks UNAVAILABLE) does not lose it:
the request goes on from its last delivered token on another serving replica, or on the same one
once Ray restarted it. Every random draw is keyed by (seed, position) and the front gave every
request a seed, so the continuation — the prompt plus the delivered tokens, the same seed, the rest
of max_new_tokens — produces exactly the tokens the unbroken stream would have
(GenerationRequest.continued); a constrained request's matchers consume the delivered tokens first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import itertools
import logging
from typing import AsyncIterator

import grpc

from duospec.cluster.scheduler_actor import CANCEL, SERVE, START, decode, encode
from duospec.cluster.secret import InternalTls, call_metadata, internal_channel
from duospec.coordinator.api import (
    CoordinatorError, FinishEvent, FinishReason, GenerationRequest, ModelInfo, ModelNotFound, SpecStats,
    TokensEvent, Unavailable,
)
from duospec.coordinator.scheduling.replicas import ReplicaState, ReplicaStatus
from duospec.coordinator.scheduling.routing import routing_policy

log = logging.getLogger("duospec.gateway")

LOAD_POLL_S = 0.1  # how often a gateway reads every scheduler's published load
LOAD_TIMEOUT_S = 2.0  # a scheduler that does not answer its load within this is not routed to
MAX_CONTINUATIONS = 3  # schedulers lost under one request before it ends UNAVAILABLE
RESTART_WAIT_S = 120.0  # how long a request waits for a lost model's only replica to come back


class _Lost(Exception):
    """A scheduler's stream that ended without its finish event."""


_LOST = object()  # what a broken link hands every request still waiting on it


class SchedulerLink:
    """This gateway's one stream to one scheduler actor, carrying all its requests there
    (cluster/scheduler_actor.py): starts and cancels go out batched, events come back batched per
    round and are handed to each request's queue. A broken stream ends every open request with _Lost."""

    def __init__(self, endpoint: str, secret: str, tls: InternalTls | None):
        self._channel = internal_channel(endpoint, tls)
        self._outgoing: asyncio.Queue = asyncio.Queue()
        self._calls: dict[int, asyncio.Queue] = {}
        self._ids = itertools.count(1)
        self.broken = False
        serve = self._channel.stream_stream(SERVE, request_serializer=encode, response_deserializer=decode)
        self._call = serve(self._commands(), metadata=call_metadata(secret))
        self._reader = asyncio.create_task(self._read(), name=f"duospec-scheduler-link-{endpoint}")

    async def _commands(self):
        while True:
            batch = [await self._outgoing.get()]
            while not self._outgoing.empty():
                batch.append(self._outgoing.get_nowait())
            yield batch

    async def _read(self) -> None:
        try:
            async for batch in self._call:
                for call, event in batch:
                    queue = self._calls.get(call)
                    if queue is not None:
                        queue.put_nowait(event)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):  # the scheduler died, or this link closed
            pass
        finally:
            self.broken = True
            for queue in self._calls.values():
                queue.put_nowait(_LOST)

    async def events(self, request: GenerationRequest) -> AsyncIterator:
        """The scheduler's events for `request`; closing this early cancels the sequence there."""
        if self.broken:
            raise _Lost("its stream is broken")
        call, queue = next(self._ids), asyncio.Queue()
        self._calls[call] = queue
        self._outgoing.put_nowait((START, call, request))
        done = False
        try:
            while True:
                event = await queue.get()
                if event is _LOST:
                    raise _Lost("its stream broke")
                if isinstance(event, CoordinatorError):
                    done = True
                    raise event
                if isinstance(event, FinishEvent):
                    done = True
                yield event
                if done:
                    return
        finally:
            self._calls.pop(call, None)
            if not done and not self.broken:
                self._outgoing.put_nowait((CANCEL, call, None))

    async def close(self) -> None:
        self._call.cancel()
        await _quietly(self._channel.close())


class RemoteReplica:
    """One scheduler actor as a gateway sees it: its published load and the channel to its endpoint.
    Implements coordinator/scheduling/routing.py's Routable."""

    def __init__(self, index: int, handle, secret: str, tls: InternalTls | None):
        self.index = index
        self.handle = handle
        self._secret, self._tls = secret, tls
        self.published: dict = {}
        self.reachable = False
        self.sent = 0  # requests sent since the last published load (it counts them from then on)
        self.sent_tokens = 0
        self._link: SchedulerLink | None = None
        self._endpoint = ""
        self._started_at = None

    @property
    def live(self) -> int:
        return int(self.published.get("live", 0)) + self.sent

    @property
    def tokens_left(self) -> int:
        return int(self.published.get("tokens_left", 0)) + self.sent_tokens

    @property
    def serving(self) -> bool:
        return self.reachable and bool(self.published.get("serving")) and bool(self.published.get("endpoint"))

    async def poll(self) -> None:
        try:
            load = await asyncio.wait_for(self.handle.load.remote(), LOAD_TIMEOUT_S)
        except Exception:  # dead, restarting or stalled: not routed to until it answers again
            self.reachable = False
            return
        if not load.get("endpoint"):  # Ray restarted it: it opens its links and endpoint on `start`
            self.reachable = False
            asyncio.ensure_future(_quietly(self.handle.start.remote()))
            return
        if load["started_at"] != self._started_at or load["endpoint"] != self._endpoint or self._link is None \
                or self._link.broken:
            await self._reconnect(load["endpoint"], load["started_at"])
        self.published, self.reachable = load, True
        self.sent = self.sent_tokens = 0

    async def _reconnect(self, endpoint: str, started_at: float) -> None:
        old, self._link = self._link, SchedulerLink(endpoint, self._secret, self._tls)
        self._endpoint, self._started_at = endpoint, started_at
        if old is not None:
            await old.close()

    def stream(self, request: GenerationRequest) -> AsyncIterator:
        """The scheduler's events for `request` (close it early to cancel the sequence)."""
        if self._link is None:
            raise Unavailable("replica has no endpoint yet")
        self.sent += 1
        self.sent_tokens += request.max_new_tokens
        return self._link.events(request)

    def status(self) -> ReplicaStatus:
        p = self.published
        state = ReplicaState(p["state"]) if self.reachable and p.get("state") else ReplicaState.DOWN
        return ReplicaStatus(self.index, state, int(p.get("live", 0)), int(p.get("tokens_left", 0)),
                             target_restarts=int(p.get("target_restarts", 0)),
                             draft_restarts=int(p.get("draft_restarts", 0)),
                             target_node_id=p.get("target_node_id", ""), draft_node_id=p.get("draft_node_id", ""))

    async def close(self) -> None:
        if self._link is not None:
            await self._link.close()


@dataclasses.dataclass
class RemoteModel:
    info: ModelInfo
    config: object  # coordinator.config.ModelConfig
    replicas: list[RemoteReplica]

    def __post_init__(self) -> None:
        self.policy = routing_policy(self.config.routing)

    @property
    def serving(self) -> bool:
        return any(r.serving for r in self.replicas)

    async def choose(self, request: GenerationRequest, timeout_s: float) -> RemoteReplica:
        """The policy's choice among the serving replicas; with none serving, waits (up to `timeout_s`)
        for one to come back, as a request waits for a restarted worker in the one-process server."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            serving = [r for r in self.replicas if r.serving]
            if serving:
                return self.policy.choose(serving, request)
            if loop.time() >= deadline:
                raise Unavailable(f"no replica of model {self.info.name!r} is serving; retry shortly")
            await asyncio.sleep(LOAD_POLL_S)


class RemoteCoordinator:
    """coordinator.api.Coordinator over a deployment's scheduler actors (cluster/deployment.py)."""

    def __init__(self, described: dict):
        secret, tls = described["secret"], described["internal_tls"]
        self.entries: dict[str, RemoteModel] = {}
        for model in described["models"]:
            replicas = [RemoteReplica(i, handle, secret, tls) for i, handle in enumerate(model["schedulers"])]
            self.entries[model["info"].name] = RemoteModel(model["info"], model["config"], replicas)
        self.default_model = next(iter(self.entries), None)
        # What every gateway of the deployment signs usage ids with (coordinator/serving/resume.py):
        # derived from the deployment's secret, so a stream broken on one gateway resumes on another
        self.resume_key = hmac.new(secret.encode(), b"duospec usage ids", hashlib.sha256).digest()
        self.closed = False
        self.continued = 0  # requests that went on after losing their scheduler
        self._poller: asyncio.Task | None = None

    @classmethod
    async def join(cls, timeout_s: float = 60.0) -> RemoteCoordinator:
        """From the deployment this Ray driver's cluster serves (cluster/deployment.py), once every
        scheduler published its load."""
        from duospec.cluster.deployment import describe

        coordinator = cls(await describe(timeout_s))
        await coordinator.start()
        return coordinator

    async def start(self) -> None:
        await self._poll_all()
        self._poller = asyncio.create_task(self._poll_loop(), name="duospec-load-poll")

    async def _poll_all(self) -> None:
        await asyncio.gather(*(r.poll() for m in self.entries.values() for r in m.replicas))

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(LOAD_POLL_S)
            await self._poll_all()

    def models(self) -> list[ModelInfo]:
        return [m.info for m in self.entries.values()]

    def _resolve(self, name: str) -> RemoteModel:
        model = self.entries.get(name or self.default_model or "")
        if model is None:
            raise ModelNotFound(f"model {name!r} is not served here; available: {', '.join(self.entries) or 'none'}")
        return model

    async def generate(self, request: GenerationRequest) -> AsyncIterator:
        if self.closed:
            raise Unavailable("the gateway is shutting down; retry")
        model = self._resolve(request.model)
        delivered: list[int] = []
        before = SpecStats()  # what the lost schedulers' part of the request counted
        now = request
        for attempt in range(MAX_CONTINUATIONS + 1):
            replica = await model.choose(now, RESTART_WAIT_S if attempt else 0.0)
            stats = None
            try:
                async with contextlib.aclosing(replica.stream(now)) as events:
                    async for event in events:
                        stats = event.stats
                        if isinstance(event, TokensEvent):
                            delivered += event.token_ids
                            yield dataclasses.replace(event, stats=before.plus(event.stats)) if attempt else event
                        else:
                            yield dataclasses.replace(event, prompt_tokens=len(request.prompt_token_ids),
                                                      completion_tokens=len(delivered),
                                                      stats=before.plus(event.stats)) if attempt else event
                            return
                raise _Lost("its stream ended without a finish")
            except _Lost as exc:
                why = str(exc)
                replica.reachable = False  # until its next published load
                log.warning("the scheduler of replica %d of %s was lost under request %s after %d tokens (%s)",
                            replica.index, model.info.name, request.request_id, len(delivered), why)
                before = before.plus(stats)
            finish = request.ended_by(tuple(delivered), model.info.end_token_ids)
            if finish is not None:  # the lost stream had delivered its last token already
                yield FinishEvent(finish, len(request.prompt_token_ids), len(delivered), before)
                return
            now = request.continued(tuple(delivered))
            self.continued += 1
        raise Unavailable(f"request {request.request_id}: {MAX_CONTINUATIONS + 1} schedulers lost under it; retry")

    async def stats(self) -> dict:
        models = {}
        for name, model in self.entries.items():
            per = {str(r.index): {**r.published.get("stats", {"live_sequences": 0}), "state": r.status().state.value,
                                  "outstanding_tokens": r.tokens_left} for r in model.replicas}
            models[name] = per["0"] if len(per) == 1 else {
                "live_sequences": sum(s.get("live_sequences", 0) for s in per.values()), "replicas": per}
        ready = bool(self.entries) and not self.closed and all(m.serving for m in self.entries.values())
        return {"ready": ready, "models": models, "continued_requests": self.continued}

    def replica_status(self, name: str) -> list[ReplicaStatus]:
        return [r.status() for r in self._resolve(name).replicas]

    async def close(self) -> None:
        """Closes this gateway's channels; the schedulers and workers stay (the deployment owns them)."""
        self.closed = True
        if self._poller is not None:
            self._poller.cancel()
        for model in self.entries.values():
            for replica in model.replicas:
                await replica.close()


async def _quietly(awaitable) -> None:
    try:
        await awaitable
    except Exception:  # closing what is dead or being replaced
        pass
