"""What both coordinators share: per-model schedulers (one per replica: coordinator/scheduling/replicas.py),
request validation, mode defaults.

`LocalCoordinator` (coordinator/local.py) and `PipelineCoordinator` (coordinator/pipeline.py) differ
only in how they open the links to the draft and target workers.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from duospec.coordinator.api import (
    GenerationRequest,
    InvalidRequest,
    ModelInfo,
    ModelNotFound,
    SpeculationMode,
    Unavailable,
)
from duospec.coordinator.config import SpeculationDefaults
from duospec.coordinator.scheduling.guard import GoodputGuard
from duospec.coordinator.scheduling.policies import SpeculationPolicy
from duospec.coordinator.scheduling.replicas import ReplicaSet, ReplicaStatus
from duospec.coordinator.scheduling.routing import routing_policy
from duospec.coordinator.scheduling.scheduler import Scheduler, SchedulerConfig


@dataclass
class ModelEntry:
    info: ModelInfo
    config: object  # coordinator.config.ModelConfig
    open_scheduler: Callable[[], Awaitable[Scheduler]]  # the first replica's
    nodes: Callable[[], tuple[str, str]] | None = None  # the first replica's (target, draft) Ray nodes
    replicas: ReplicaSet = field(default_factory=ReplicaSet)

    def __post_init__(self) -> None:
        self.replicas.policy = routing_policy(self.config.routing)
        self.replicas.add(self.open_scheduler, self.nodes)

    def add_replica(self, open_scheduler: Callable[[], Awaitable[Scheduler]],
                    nodes: Callable[[], tuple[str, str]] | None = None) -> None:
        self.replicas.add(open_scheduler, nodes)

    @property
    def scheduler(self) -> Scheduler | None:
        """The first replica's scheduler (the model's only one unless models[].replicas > 1)."""
        return self.replicas.replicas[0].scheduler

    async def get_scheduler(self) -> Scheduler:
        return await self.replicas.replicas[0].get_scheduler()


def scheduler_config(model_config) -> SchedulerConfig:
    return SchedulerConfig(
        max_batch_size=int(model_config.max_batch_size),
        max_num_seqs=int(model_config.max_num_seqs),
        prefill_chunk_tokens=int(model_config.prefill_chunk_tokens),
        hang_timeout_s=float(model_config.hang_timeout_s),
    )


class ModelRouter:
    """Implements coordinator.api.Coordinator over one scheduler per served model."""

    def __init__(self) -> None:
        self.entries: dict[str, ModelEntry] = {}
        self.default_model: str | None = None
        self.closed = False

    def add_model(self, entry: ModelEntry) -> None:
        self.entries[entry.info.name] = entry
        if self.default_model is None:
            self.default_model = entry.info.name

    def swap_guards(self, swap: Callable[[tuple[str, int], GoodputGuard], GoodputGuard]) -> None:
        """Gives every open scheduler the goodput guard `swap((model, replica index), its current
        guard)` returns (nothing may be in flight): a caller that runs distinct workloads one after
        another on the same workers (duospec/bench/guards.py) keeps what each one's guard learned."""
        for name, entry in self.entries.items():
            for replica in entry.replicas.replicas:
                if replica.scheduler is not None:
                    replica.scheduler.guard = swap((name, replica.index), replica.scheduler.guard)

    def models(self) -> list[ModelInfo]:
        return [entry.info for entry in self.entries.values()]

    def resolve(self, name: str) -> ModelEntry:
        entry = self.entries.get(name or self.default_model or "")
        if entry is None:
            known = ", ".join(self.entries) or "none"
            raise ModelNotFound(f"model {name!r} is not served here; available: {known}")
        return entry

    def policy_for(self, entry: ModelEntry, request: GenerationRequest) -> SpeculationPolicy:
        """The model's speculation defaults (coordinator/config.py SpeculationDefaults, the one place they
        are written), overridden by what the request asks for."""
        spec: SpeculationDefaults = entry.config.speculation
        mode = (request.mode or spec.mode) if entry.info.has_draft else SpeculationMode.OFF
        use_cache = spec.cache if request.speculation_cache is None else request.speculation_cache
        use_tree = spec.tree if request.speculation_tree is None else request.speculation_tree
        return SpeculationPolicy(
            mode=mode,
            max_draft_tokens=request.max_draft_tokens or spec.draft_tokens(mode),
            max_lookahead=spec.max_lookahead,
            adaptive=spec.adaptive,
            hedges=spec.hedges if use_cache else 0,
            tree_nodes=spec.tree_nodes if use_cache and use_tree else 0,
            lookup=spec.lookup,
        )

    def validate(self, entry: ModelEntry, request: GenerationRequest) -> None:
        info = entry.info
        ids = request.prompt_token_ids
        if not ids:
            raise InvalidRequest("prompt is empty: send at least one token")
        bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"prompt_token_ids: id {bad} is outside the vocabulary [0, {info.vocab_size})")
        if request.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens={request.max_new_tokens}: must be >= 1")
        if len(ids) + request.max_new_tokens > info.max_context:
            raise InvalidRequest(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({request.max_new_tokens}) exceeds the model "
                f"context of {info.max_context} tokens; shorten the prompt or lower max_new_tokens"
            )
        problem = None if request.max_draft_tokens is None else info.draft_tokens_problem(request.max_draft_tokens)
        if problem:
            raise InvalidRequest(f"max_draft_tokens: {problem}")
        if request.logprobs is not None and not 0 <= request.logprobs <= 20:
            raise InvalidRequest(f"logprobs={request.logprobs}: ask for 0 to 20 alternatives")
        if not (math.isfinite(request.priority_weight) and request.priority_weight > 0):
            raise InvalidRequest("priority_weight must be a positive number")
        try:
            request.sampling.validate()
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None

    async def generate(self, request: GenerationRequest):
        if self.closed:
            raise Unavailable("the coordinator is shutting down; retry on another replica")
        entry = self.resolve(request.model)
        self.validate(entry, request)
        policy = self.policy_for(entry, request)

        def run(scheduler: Scheduler):
            return scheduler.generate(request, policy)

        async with contextlib.aclosing(entry.replicas.generate(request, run)) as events:
            async for event in events:
                yield event

    def ready(self) -> bool:
        """True once every model's workers are loaded and while each model has a replica whose target
        is connected (a model whose every target is down or restarting makes the server NOT_SERVING)."""
        return bool(self.entries) and not self.closed and all(e.replicas.serving for e in self.entries.values())

    async def stats(self) -> dict:
        return {"ready": self.ready(), "models": {name: entry.replicas.stats() for name, entry in self.entries.items()}}

    def replica_status(self, name: str) -> list[ReplicaStatus]:
        """Each replica of model `name`: its state, load and restarts (ListModels, for admins)."""
        return [replica.status() for replica in self.resolve(name).replicas.replicas]

    async def close(self) -> None:
        self.closed = True
        for entry in self.entries.values():
            for scheduler in entry.replicas.open_schedulers:
                await scheduler.close()
