"""Launching the named, restartable draft and target actors of one model pair (one replica of a model:
models[].replicas pairs are launched each with its own index, named apart). A worker whose model is
split over several devices is rank 0 of a tensor-parallel group; it starts the other ranks itself
(cluster/tp_group.py) in the bundles its plan reserves for them."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from duospec.cluster.placement import PlacementError, PlacementPlan, create_placement_groups, plan_placement
from duospec.cluster.runtime import NAMESPACE
from duospec.cluster.secret import InternalTls, new_deployment_secret
from duospec.cluster.tp_group import GroupLayout
from duospec.draft_worker.proposer import DraftMethod, DraftSpec

log = logging.getLogger(__name__)


def replica_label(model: str, replica: int = 0) -> str:
    """How a replica is named apart (actors, placement groups, worker stats): replica 0 by the model's
    name, as a model of one pair always was; '#' is no model name's character, so no collision."""
    return f"{model}#{replica}" if replica else model


def actor_name(role: str, model: str, replica: int = 0) -> str:
    return f"duospec-{role}-{replica_label(model, replica)}"


@dataclass
class WorkerPair:
    model: str
    target: object  # ray ActorHandle (TargetWorker; rank 0 of its group)
    draft: object | None  # ray ActorHandle (DraftWorker; rank 0 of its group)
    placement_groups: tuple  # Ray placement groups (one for the pair, or one per tensor-parallel group)
    target_info: dict
    draft_info: dict | None
    # what every internal stream to these workers must carry (cluster/secret.py); out of the repr, so
    # a log line or an error that prints the pair does not hand it out
    deployment_secret: str = field(repr=False)
    internal_tls: InternalTls | None = None  # mutual TLS on those streams, when the deployment has it
    replica: int = 0  # which of the model's replicas

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for handle in (self.draft, self.target):
            if handle is not None:
                try:
                    ray.kill(handle, no_restart=True)
                except Exception:  # already gone
                    pass
        for group in self.placement_groups or ():
            try:
                remove_placement_group(group)
            except Exception:
                pass


def launch_pair(
    model: str,
    target_path: str,
    draft: DraftSpec | str | None,
    *,
    device: str = "auto",
    dtype: str = "auto",
    max_slots: int = 16,
    max_context: int | None = None,
    placement_timeout_s: float = 30.0,
    load_timeout_s: float = 300.0,
    max_restarts: int = -1,  # Ray restarts a dead worker for as long as the deployment runs
    deployment_secret: str | None = None,
    internal_tls: InternalTls | None = None,
    prefill_chunk_tokens: int | None = None,
    placement: str = "auto",
    replica: int = 0,
    target_tp: int = 1,
    kv: dict | None = None,
) -> WorkerPair:
    """Places and starts the pair; `deployment_secret` (default: a new one) authenticates the streams;
    `max_context`: positions per sequence on both workers (the serve config's max_model_len);
    `placement`: auto | separate | colocated (cluster/placement.py). `load_timeout_s` bounds each wait for
    workers to load: one wait for a separate pair, two in a row for a colocated one (the draft first).
    `replica`: the pair's index among the model's replicas; `target_tp`: the target's tensor-parallel
    size (the draft's is its spec's).
    `kv`: {role: KVOptions} each worker's KV pool (default: the engine's)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from duospec.draft_worker.actor import DraftWorker
    from duospec.target_worker.actor import TargetWorker

    for role in ("draft", "target"):
        try:
            ray.get_actor(actor_name(role, model, replica), namespace=NAMESPACE)
        except ValueError:
            continue
        raise PlacementError(
            f"actor {actor_name(role, model, replica)!r} already exists in Ray namespace {NAMESPACE!r}: another duospec "
            f"serve is running this model on the cluster; stop it or serve under another model name"
        )
    deployment_secret = deployment_secret or new_deployment_secret()
    if isinstance(draft, str):  # a draft checkpoint path: the model drafter
        draft = DraftSpec(DraftMethod.MODEL, path=draft)
    use_gpu = {"cpu": False, "cuda": True}.get(device)
    plan = plan_placement(ray.nodes(), use_gpu=use_gpu, draft_needs_gpu=draft is not None and draft.method.needs_model,
                          placement=placement, target_tp=target_tp,
                          draft_tp=draft.tensor_parallel_size if draft is not None else 1)
    label = f"duospec-{replica_label(model, replica)}"
    log.info("placing %s: %s", label, plan.description)
    groups = create_placement_groups(plan, name=label, timeout_s=placement_timeout_s)
    pair = WorkerPair(model, None, None, groups, {}, None, deployment_secret, internal_tls, replica)
    kv = dict(kv or {})
    if plan.colocated and kv.get("draft") is not None:
        # A GPU fraction is of everything in use: the draft, loading first, would take it all. It gets
        # one slot's worth per sequence (or its own byte count); the target the fraction's rest.
        kv["draft"] = dataclasses.replace(kv["draft"], gpu_memory_utilization=None)
    roles = (("draft", DraftWorker, (draft, target_path, prefill_chunk_tokens)),
             ("target", TargetWorker, (target_path, draft.feature_layers(target_path) if draft is not None else ())))
    infos = {}
    try:
        for role, cls, args in roles:
            if role == "draft" and draft is None:
                continue
            if plan.colocated and pair.draft is not None:
                # One GPU's memory for both: each worker checks at load that its KV cache fits in what is
                # free, so the target loads only once the draft holds its weights and cache — started
                # together, both would see the whole GPU free and could jointly overcommit it.
                infos.update(_wait_loaded(model, {"draft": pair.draft}, load_timeout_s))
            slots = getattr(plan, role)
            handle = (
                ray.remote(cls)
                .options(
                    name=actor_name(role, model, replica),
                    namespace=NAMESPACE,
                    num_cpus=slots[0].resources.get("CPU", 1),
                    num_gpus=slots[0].resources.get("GPU", 0),
                    max_restarts=max_restarts,
                    max_concurrency=4,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        groups[slots[0].group], placement_group_bundle_index=slots[0].bundle),
                )
                .remote(*args, deployment_secret=deployment_secret, internal_tls=internal_tls, device=device,
                        dtype=dtype, max_slots=max_slots, max_context=max_context, kv=kv.get(role),
                        tensor_parallel=_layout(plan, role, groups, load_timeout_s))
            )
            setattr(pair, role, handle)  # from here on a failure stops it too
        waiting = {role: h for role, h in (("draft", pair.draft), ("target", pair.target))
                   if h is not None and role not in infos}
        infos.update(_wait_loaded(model, waiting, load_timeout_s))
    except BaseException:  # a worker failed to load, or creating the second actor failed: free the first
        pair.shutdown()
        raise
    pair.target_info = infos["target"]
    pair.draft_info = infos.get("draft")
    return pair


def _layout(plan: PlacementPlan, role: str, groups: tuple, timeout_s: float) -> GroupLayout | None:
    """Where rank 0 of the role's worker starts its other ranks; None for a worker of one rank."""
    slots = getattr(plan, role)
    if len(slots) == 1:
        return None
    return GroupLayout(world=len(slots), placement_group=groups[slots[0].group],
                       bundles=tuple(slot.bundle for slot in slots[1:]), resources=slots[1].resources,
                       join_timeout_s=timeout_s)


def _wait_loaded(model: str, handles: dict, timeout_s: float) -> dict[str, dict]:
    """{role: info} once every worker in `handles` has loaded; a PlacementError naming the cause if one
    does not (the caller stops the pair)."""
    import ray

    try:
        return dict(zip(handles, ray.get([h.info.remote() for h in handles.values()], timeout=timeout_s)))
    except Exception as exc:
        cause = getattr(exc, "cause", None) or exc
        raise PlacementError(f"the {model} workers failed to start: {type(cause).__name__}: {cause}") from None
