"""The distributed coordinator: draft and target in separate Ray actors, data over gRPC streams.

    coordinator = start_pipeline([ModelConfig(...)], ray_address=None)   # None: a local Ray
    async for event in coordinator.generate(request): ...
    await coordinator.close()                                            # kills the actors
"""

from __future__ import annotations

import dataclasses
import logging

from cluster.actors import WorkerPair, launch_pair
from cluster.runtime import connect
from coordinator.links import GrpcStreamLink, wait_for_channel
from coordinator.models import model_info
from coordinator.router import ModelEntry, ModelRouter, scheduler_config
from coordinator.scheduler import Scheduler

log = logging.getLogger(__name__)


class PipelineCoordinator(ModelRouter):
    def __init__(self) -> None:
        super().__init__()
        self.pairs: dict[str, WorkerPair] = {}

    def add_pair(self, config, pair: WorkerPair) -> None:
        info = model_info(config)
        info = dataclasses.replace(
            info,
            target_node_id=pair.target_info["node_id"],
            draft_node_id=(pair.draft_info or {}).get("node_id", ""),
        )
        self.pairs[info.name] = pair

        async def open_scheduler() -> Scheduler:
            await wait_for_channel(pair.target_info["endpoint"], timeout=30)
            target = GrpcStreamLink(pair.target_info["endpoint"], "verify")
            draft = GrpcStreamLink(pair.draft_info["endpoint"], "draft") if pair.draft_info else None
            scheduler = Scheduler(info, target, draft, scheduler_config(config))
            await scheduler.start()
            return scheduler

        self.add_model(ModelEntry(info, config, open_scheduler))

    def worker_info(self) -> dict:
        return {name: {"target": p.target_info, "draft": p.draft_info} for name, p in self.pairs.items()}

    async def close(self) -> None:
        await super().close()
        for pair in self.pairs.values():
            pair.shutdown()
        self.pairs.clear()


def start_pipeline(models: list, *, ray_address: str | None = None, placement_timeout_s: float = 30.0):
    """Joins (or starts) Ray, places each model's draft and target on different GPUs, loads them.
    Raises ClusterUnavailable / PlacementError / CheckpointError with a clear message."""
    connect(ray_address)
    coordinator = PipelineCoordinator()
    try:
        for config in models:
            model_info(config)  # fail on a bad checkpoint or tokenizer mismatch before placing anything
            pair = launch_pair(
                config.name,
                str(config.target),
                str(config.draft) if getattr(config, "draft", None) else None,
                device=getattr(config, "device", "auto"),
                dtype=getattr(config, "dtype", "auto"),
                max_slots=scheduler_config(config).max_sequences,
                placement_timeout_s=placement_timeout_s,
            )
            coordinator.add_pair(config, pair)
    except BaseException:
        for pair in coordinator.pairs.values():
            pair.shutdown()
        raise
    return coordinator
