"""The distributed coordinator: draft and target in separate Ray actors (each possibly a tensor-parallel
group), data over gRPC streams; models[].replicas pairs of a model, routed by coordinator/scheduling/replicas.py.

    coordinator = start_pipeline([ModelConfig(...)], ray_address=None)   # None: a local Ray
    async for event in coordinator.generate(request): ...
    await coordinator.close()                                            # kills the actors
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from duospec.cluster.actors import WorkerPair, launch_pair, replica_label
from duospec.cluster.runtime import connect
from duospec.cluster.secret import InternalTls, new_deployment_secret
from duospec.coordinator.api import ModelInfo
from duospec.coordinator.scheduling.links import GrpcStreamLink, LinkLoss, wait_for_channel
from duospec.coordinator.models import model_info, worker_kv
from duospec.coordinator.scheduling.router import ModelEntry, ModelRouter, scheduler_config
from duospec.coordinator.scheduling.scheduler import Scheduler

log = logging.getLogger(__name__)


class PipelineCoordinator(ModelRouter):
    def __init__(self) -> None:
        super().__init__()
        self.pairs: dict[str, WorkerPair] = {}  # by replica_label: the model's name for its first replica
        self.launched: list[tuple[ModelInfo, WorkerPair]] = []  # every replica, with its model's facts

    def add_pair(self, config, pair: WorkerPair, info: ModelInfo | None = None) -> None:
        """`info`: the model's facts when the caller has read them already (start_pipeline has). The
        model's first pair (pair.replica 0) adds the model; each further one a replica of it."""
        info = dataclasses.replace(
            info or model_info(config),
            target_node_id=pair.target_info["node_id"],
            draft_node_id=(pair.draft_info or {}).get("node_id", ""),
        )
        self.pairs[replica_label(info.name, pair.replica)] = pair
        self.launched.append((info, pair))

        async def open_scheduler() -> Scheduler:
            return await open_pair_scheduler(config, info, pair)

        def nodes() -> tuple[str, str]:  # where its workers run now (a restarted one may have moved)
            return pair.target_info.get("node_id", ""), (pair.draft_info or {}).get("node_id", "")

        if pair.replica == 0:
            self.add_model(ModelEntry(info, config, open_scheduler, nodes))
        else:
            self.entries[info.name].add_replica(open_scheduler, nodes)

    async def worker_stats(self) -> dict:
        """What each worker actor itself holds (live sequences / free slots): {model: {role: stats}}, a
        model's further replicas under their replica_label."""
        out = {}
        for name, pair in self.pairs.items():
            handles = {"target": pair.target, "draft": pair.draft}
            out[name] = {}
            for role, handle in handles.items():
                if handle is not None:
                    try:
                        out[name][role] = await asyncio.wait_for(handle.stats.remote(), 10)
                    except Exception as exc:  # restarting or dead
                        out[name][role] = {"error": type(exc).__name__}
        return out

    def worker_info(self) -> dict:
        return {name: {"target": p.target_info, "draft": p.draft_info} for name, p in self.pairs.items()}

    async def close(self) -> None:
        await super().close()
        for pair in self.pairs.values():
            pair.shutdown()
        self.pairs.clear()


async def open_pair_scheduler(config, info: ModelInfo, pair: WorkerPair) -> Scheduler:
    """One replica's scheduler, linked to its pair's workers, with the reconnectors that follow Ray's
    restarts of them (in this process, or in the replica's scheduler actor: cluster/scheduler_actor.py)."""
    await wait_for_channel(pair.target_info["endpoint"], timeout=30, tls=pair.internal_tls)
    secret, tls = pair.deployment_secret, pair.internal_tls
    sched_config = scheduler_config(config)
    hang_s = sched_config.hang_timeout_s
    target = GrpcStreamLink(pair.target_info["endpoint"], "verify", secret, tls, hang_timeout_s=hang_s)
    draft = GrpcStreamLink(pair.draft_info["endpoint"], "draft", secret, tls,
                           hang_timeout_s=hang_s) if pair.draft_info else None
    bound = float(config.restart_timeout_s)  # how long a killed worker may take
    scheduler = Scheduler(
        info,
        target,
        draft,
        sched_config,
        reconnect_target=_reconnector(pair, "target", bound, hang_s),
        reconnect_draft=_reconnector(pair, "draft", bound, hang_s) if pair.draft else None,
    )
    await scheduler.start()
    return scheduler


def _reconnector(pair: WorkerPair, role: str, timeout_s: float, hang_timeout_s: float):
    """Waits for Ray to restart the role's actor, then opens a stream to its new endpoint. A hung
    actor (LinkLoss.HUNG, or SILENT and not answering within `hang_timeout_s`) is killed first: Ray
    restarts it (max_restarts), where waiting would never end."""
    method = "verify" if role == "target" else "draft"

    async def reconnect(loss: LinkLoss = LinkLoss.CLOSED) -> GrpcStreamLink:
        import ray

        loop = asyncio.get_running_loop()
        handle, old = getattr(pair, role), getattr(pair, f"{role}_info") or {}
        replaced = loss is LinkLoss.HUNG or (loss is LinkLoss.SILENT and not await _answers(handle, hang_timeout_s))
        if replaced:
            log.error("the %s worker of %s (pid %s) does not answer: killing it for Ray to restart", role,
                      pair.model, old.get("pid"))
            try:
                ray.kill(handle, no_restart=False)
            except Exception as exc:  # already dead: Ray restarts it (or the wait below says why not)
                log.warning("killing the %s worker of %s failed: %s", role, pair.model, exc)
        deadline = loop.time() + timeout_s
        last_error: Exception | None = None
        while loop.time() < deadline:
            handle = getattr(pair, role)
            try:
                info = await asyncio.wait_for(handle.info.remote(), max(1.0, min(10.0, deadline - loop.time())))
                if replaced and info.get("started_at") == old.get("started_at"):
                    raise ConnectionError("the killed process still answers; waiting for its replacement")
                await wait_for_channel(info["endpoint"], timeout=max(1.0, deadline - loop.time()), tls=pair.internal_tls)
                setattr(pair, f"{role}_info", info)
                return GrpcStreamLink(info["endpoint"], method, pair.deployment_secret, pair.internal_tls,
                                      hang_timeout_s=hang_timeout_s)
            except Exception as exc:  # still restarting
                last_error = exc
                await asyncio.sleep(0.5)
        raise ConnectionError(f"the {role} actor did not restart within {timeout_s:.0f} s: {last_error}")

    return reconnect


async def _answers(handle, within_s: float) -> bool:
    """False when the actor leaves a call unanswered for `within_s` seconds (a stopped process never
    answers); an actor that is dead or restarting is Ray's to restart, not ours to kill."""
    try:
        await asyncio.wait_for(handle.info.remote(), within_s)
    except asyncio.TimeoutError:
        return False
    except Exception:  # dead or restarting
        pass
    return True


def start_pipeline(models: list, *, ray_address: str | None = None, internal_tls: InternalTls | None = None,
                   num_cpus: int | None = None):
    """Joins (or starts) Ray, places each model's draft and target on different GPUs (each replica's,
    each tensor-parallel rank on its own; each replica waiting up to its model's placement_timeout_s
    for them), loads them.
    `internal_tls`: mutual TLS on the coordinator-worker streams (cluster/secret.py).
    `num_cpus`: the logical CPUs a local Ray declares (ray_address None; default the machine's cores).
    Raises ClusterUnavailable / PlacementError / CheckpointError with a clear message."""
    connect(ray_address, num_cpus=num_cpus)
    coordinator = PipelineCoordinator()
    secret = new_deployment_secret()  # one per deployment: every pair's streams carry it
    try:
        for config in models:
            info = model_info(config)  # fail on a bad checkpoint or tokenizer mismatch before placing anything
            for replica in range(config.replicas):
                _launch_replica(coordinator, config, info, replica, secret, internal_tls)
    except BaseException:
        for pair in coordinator.pairs.values():
            pair.shutdown()
        raise
    return coordinator


def _launch_replica(coordinator: PipelineCoordinator, config, info: ModelInfo, replica: int, secret: str,
                    internal_tls: InternalTls | None) -> None:
    pair = launch_pair(
        config.name,
        str(config.target),
        config.draft,
        device=config.device,
        placement=config.placement,
        dtype=config.dtype,
        max_slots=scheduler_config(config).max_num_seqs,
        max_context=info.max_context,
        replica=replica,
        target_tp=config.tensor_parallel_size,
        placement_timeout_s=config.placement_timeout_s,
        deployment_secret=secret,
        internal_tls=internal_tls,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
        kv={role: worker_kv(config, role) for role in ("target", "draft")},
    )
    coordinator.add_pair(config, pair, info)
