"""Placing the draft and the target on different GPUs (DESIGN.md §2).

    one node with >= 2 GPUs      → two {GPU: 1} bundles on that node (different GPU ids)
    >= 2 nodes with >= 1 GPU     → STRICT_SPREAD: one bundle per node
    no GPUs at all (CPU cluster) → two {CPU: 1} bundles; each actor uses one torch thread
    exactly one GPU              → error: the pair needs two (or run both on CPU)
    a model-free drafter (ngram) → the target's {GPU: 1} bundle plus a {CPU: 1} draft bundle, packed:
                                   one GPU anywhere is enough
"""

from __future__ import annotations

from dataclasses import dataclass


class PlacementError(RuntimeError):
    """The cluster cannot host the draft/target pair; the message says what is missing."""


@dataclass(frozen=True)
class PlacementPlan:
    strategy: str  # a Ray placement-group strategy
    bundles: tuple[dict, ...]  # (draft bundle, target bundle)
    uses_gpu: bool
    description: str


def plan_placement(nodes: list[dict], *, use_gpu: bool | None = None, draft_needs_gpu: bool = True) -> PlacementPlan:
    """Pure: decides the placement from `ray.nodes()`-style dicts (Alive, Resources).
    `draft_needs_gpu=False`: the drafter loads no model (n-gram); only the target asks for a GPU."""
    alive = [n for n in nodes if n.get("Alive", n.get("alive", True))]
    gpus_per_node = [int(n.get("Resources", {}).get("GPU", 0)) for n in alive]
    total = sum(gpus_per_node)
    if use_gpu is None:
        use_gpu = total > 0
    if not use_gpu:
        return PlacementPlan("PACK", ({"CPU": 1}, {"CPU": 1}), False, "CPU only: two 1-CPU actors")
    if not draft_needs_gpu:
        if total < 1:
            raise PlacementError(
                f"the target needs a GPU, but the cluster has none across {len(alive)} node(s); add a GPU "
                f"node, or set `device: cpu` in the model config"
            )
        return PlacementPlan(
            "PACK", ({"CPU": 1}, {"GPU": 1, "CPU": 1}), True, "target on one GPU, model-free drafter on a CPU"
        )
    if any(g >= 2 for g in gpus_per_node):
        return PlacementPlan(
            "PACK", ({"GPU": 1, "CPU": 1}, {"GPU": 1, "CPU": 1}), True, "one node, two GPUs (one each)"
        )
    if sum(1 for g in gpus_per_node if g >= 1) >= 2:
        return PlacementPlan(
            "STRICT_SPREAD", ({"GPU": 1, "CPU": 1}, {"GPU": 1, "CPU": 1}), True, "two nodes, one GPU each"
        )
    raise PlacementError(
        f"the draft and target need a GPU each, but the cluster has {total} GPU(s) across {len(alive)} "
        f"node(s); add a GPU node, or set `device: cpu` in the model config to run both on CPU"
    )


def create_placement_group(plan: PlacementPlan, *, name: str, timeout_s: float = 30.0):
    """Reserves the bundles; raises PlacementError (and frees the group) if they can't be placed."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(list(plan.bundles), strategy=plan.strategy, name=name)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise PlacementError(
            f"could not place the draft and target ({plan.description}: bundles {list(plan.bundles)}, "
            f"strategy {plan.strategy}) within {timeout_s:.0f} s; the cluster lacks free resources — "
            f"check `ray status`"
        )
    return group
