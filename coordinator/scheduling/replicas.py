"""A model's replicas: models[].replicas independent draft/target pairs (or tensor-parallel groups),
one Scheduler each, behind one model name (docs/design.md#engine, scale out).

Each request goes to one replica, chosen by a RoutingPolicy when it arrives and kept for its life:
by default the serving replica with the least outstanding work — tokens its live sequences may still
produce, then live sequences. A replica whose target is down or restarting gets no new request while
another serves; its live requests wait for the restarted worker and recover as with one pair
(coordinator/scheduling/recovery.py). What is per model stays per model whatever the replica: tenancy, the
server's admission queue, quotas, the ledger and the per-tenant metrics; fair share between tenants
is kept inside each replica's scheduler, over the requests routed to it.

The choice is a RoutingPolicy's (models[].routing, coordinator/scheduling/routing.py): it sees the
request (its prompt and tenant) and every replica. `least_work` (the default) is the above;
`prefix_affinity` keeps prompts that share their leading blocks on one replica, where the prefix
cache has them, while the load allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from duospec.coordinator.api import FinishEvent, GenerationRequest, TokensEvent
from duospec.coordinator.scheduling.routing import LeastOutstandingWork, RoutingPolicy
from duospec.coordinator.scheduling.scheduler import Scheduler


class ReplicaState(enum.Enum):
    SERVING = "serving"  # takes new requests (also before its first: the workers are loaded)
    DEGRADED = "degraded"  # serving target-only: its drafter is down or restarting
    DOWN = "down"  # its target is down or restarting: no new requests while another replica serves


@dataclass(frozen=True)
class ReplicaStatus:
    """What an admin sees of one replica (ListModels, `duospec models`)."""

    index: int
    state: ReplicaState
    live_sequences: int
    outstanding_tokens: int
    target_restarts: int = 0
    draft_restarts: int = 0
    target_node_id: str = ""  # Ray nodes ("" in-process)
    draft_node_id: str = ""


@dataclass
class Replica:
    index: int
    open_scheduler: Callable[[], Awaitable[Scheduler]]
    nodes: Callable[[], tuple[str, str]] | None = None  # where its (target, draft) run now, when on Ray
    scheduler: Scheduler | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    live: int = 0  # requests routed here and not finished
    tokens_left: int = 0  # tokens those may still produce (their max_new_tokens not yet generated)

    async def get_scheduler(self) -> Scheduler:
        if self.scheduler is None:
            async with self.lock:
                if self.scheduler is None:
                    self.scheduler = await self.open_scheduler()
        return self.scheduler

    @property
    def state(self) -> ReplicaState:
        scheduler = self.scheduler
        if scheduler is None:
            return ReplicaState.SERVING
        if not scheduler.target_serving:
            return ReplicaState.DOWN
        if scheduler.info.has_draft and not scheduler.stats()["draft"]["connected"]:
            return ReplicaState.DEGRADED
        return ReplicaState.SERVING

    @property
    def serving(self) -> bool:
        """Not DOWN (read on every routing decision, so without building the stats `state` reads)."""
        return self.scheduler is None or self.scheduler.target_serving

    def status(self, stats: dict | None = None) -> ReplicaStatus:
        """`stats`: its scheduler's stats when the caller has them already (they are not cheap)."""
        if stats is None:
            stats = self.scheduler.stats() if self.scheduler is not None else {}
        target_node, draft_node = self.nodes() if self.nodes is not None else ("", "")
        return ReplicaStatus(self.index, self.state, self.live, self.tokens_left,
                             target_restarts=stats.get("target", {}).get("restarts", 0),
                             draft_restarts=stats.get("draft", {}).get("restarts", 0),
                             target_node_id=target_node, draft_node_id=draft_node or "")


class ReplicaSet:
    """A model's replicas and the routing between them."""

    def __init__(self, policy: RoutingPolicy | None = None) -> None:
        self.replicas: list[Replica] = []
        self.policy = policy or LeastOutstandingWork()

    def add(self, open_scheduler: Callable[[], Awaitable[Scheduler]],
            nodes: Callable[[], tuple[str, str]] | None = None) -> Replica:
        replica = Replica(len(self.replicas), open_scheduler, nodes)
        self.replicas.append(replica)
        return replica

    @property
    def open_schedulers(self) -> list[Scheduler]:
        return [r.scheduler for r in self.replicas if r.scheduler is not None]

    @property
    def serving(self) -> bool:
        """True while any replica serves (health: SERVING)."""
        return any(r.serving for r in self.replicas)

    async def generate(self, request: GenerationRequest, run: Callable[[Scheduler], AsyncIterator]) -> AsyncIterator:
        """Routes `request` and yields what `run(scheduler)` yields (closing it when closed early: that
        cancels the sequence), counting the replica's outstanding work as it goes. Every replica's
        scheduler is opened at the model's first request, so the choice sees which of them serve."""
        if any(r.scheduler is None for r in self.replicas):
            opened = await asyncio.gather(*(r.get_scheduler() for r in self.replicas), return_exceptions=True)
            if all(isinstance(result, BaseException) for result in opened):
                raise opened[0]  # one that failed to open is tried again at the next request
        replica = self.policy.choose([r for r in self.replicas if r.scheduler is not None], request)
        left = request.max_new_tokens
        replica.live += 1
        replica.tokens_left += left
        try:
            async with contextlib.aclosing(run(replica.scheduler)) as events:
                async for event in events:
                    if isinstance(event, TokensEvent):
                        done = min(left, len(event.token_ids))
                        left -= done
                        replica.tokens_left -= done
                    elif isinstance(event, FinishEvent):
                        replica.tokens_left -= left
                        left = 0
                    yield event
        finally:
            replica.live -= 1
            replica.tokens_left -= left

    def stats(self) -> dict:
        """One replica: its scheduler's stats as they always were; several: the live sequences of all
        and each replica's stats (with its state) under "replicas"."""
        per_replica = {str(r.index): {**(r.scheduler.stats() if r.scheduler is not None else {"live_sequences": 0}),
                                      "state": r.state.value, "outstanding_tokens": r.tokens_left}
                       for r in self.replicas}
        if len(self.replicas) == 1:
            return per_replica["0"]
        return {"live_sequences": sum(s["live_sequences"] for s in per_replica.values()), "replicas": per_replica}
