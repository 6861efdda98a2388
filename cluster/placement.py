"""Placing the draft and the target (docs/design.md#processes-and-planes).

`placement: separate` (each model its own GPU; the overlap PEARL needs):
    one node with >= 2 GPUs      → two {GPU: 1} bundles on that node (different GPU ids)
    >= 2 nodes with >= 1 GPU     → STRICT_SPREAD: one bundle per node
`placement: colocated` (both on one GPU, each actor a fraction of it):
    one {GPU: 1, CPU: 2} bundle; the target takes TARGET_GPU_SHARE of the GPU, the draft the rest
`placement: auto` (the default): separate where the cluster has two GPUs, else colocated where it
    has exactly one, so a single-GPU machine runs duospec out of the box
no GPUs at all (CPU cluster)     → two {CPU: 1} bundles; each actor uses one torch thread
a model-free drafter (ngram, medusa) → the target's {GPU: 1} bundle plus a {CPU: 1} draft bundle, packed:
                                   one GPU anywhere is enough

Ray's GPU fractions are bookkeeping only: colocated actors see the same device and share its memory
and compute. Each worker checks at load that its KV cache fits in what is free then, so a colocated
pair loads one after the other (the draft first; cluster/actors.py): the target's check then sees
what the draft holds.
"""

from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("auto", "separate", "colocated")
# Colocated: the target does most of the work; the split only decides what Ray counts as taken.
TARGET_GPU_SHARE = 0.75


class PlacementError(RuntimeError):
    """The cluster cannot host the draft/target pair; the message says what is missing."""


@dataclass(frozen=True)
class PlacementPlan:
    strategy: str  # a Ray placement-group strategy
    bundles: tuple[dict, ...]  # what the placement group reserves
    uses_gpu: bool
    description: str
    # (draft, target): the bundle each actor runs in, and what it asks of that bundle
    bundle_of: tuple[int, int] = (0, 1)
    actor_resources: tuple[dict, dict] | None = None  # None: each actor takes its whole bundle

    def resources(self, role_index: int) -> dict:
        """{"CPU": .., "GPU": ..} the actor of role 0 (draft) or 1 (target) asks for."""
        if self.actor_resources is not None:
            return self.actor_resources[role_index]
        return self.bundles[self.bundle_of[role_index]]

    @property
    def colocated(self) -> bool:
        return self.bundle_of[0] == self.bundle_of[1]


def _colocated() -> PlacementPlan:
    return PlacementPlan(
        "PACK", ({"GPU": 1, "CPU": 2},), True,
        f"both on one GPU (colocated: target {TARGET_GPU_SHARE:g}, draft {1 - TARGET_GPU_SHARE:g} of it)",
        bundle_of=(0, 0),
        actor_resources=({"GPU": 1 - TARGET_GPU_SHARE, "CPU": 1}, {"GPU": TARGET_GPU_SHARE, "CPU": 1}),
    )


def plan_placement(nodes: list[dict], *, use_gpu: bool | None = None, draft_needs_gpu: bool = True,
                   placement: str = "auto") -> PlacementPlan:
    """Pure: decides the placement from `ray.nodes()`-style dicts (Alive, Resources).
    `draft_needs_gpu=False`: the drafter loads no model (n-gram); only the target asks for a GPU.
    `placement`: auto | separate | colocated (module docstring)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r}: use one of {', '.join(PLACEMENTS)}")
    alive = [n for n in nodes if n.get("Alive", n.get("alive", True))]
    gpus_per_node = [int(n.get("Resources", {}).get("GPU", 0)) for n in alive]
    total = sum(gpus_per_node)
    if use_gpu is None:
        use_gpu = total > 0
    if not use_gpu:
        return PlacementPlan("PACK", ({"CPU": 1}, {"CPU": 1}), False, "CPU only: two 1-CPU actors")
    if total < 1:
        raise PlacementError(
            f"the target needs a GPU, but the cluster has none across {len(alive)} node(s); add a GPU "
            f"node, or set `device: cpu` in the model config"
        )
    if not draft_needs_gpu:
        return PlacementPlan(
            "PACK", ({"CPU": 1}, {"GPU": 1, "CPU": 1}), True, "target on one GPU, model-free drafter on a CPU"
        )
    if placement == "colocated":
        return _colocated()
    if any(g >= 2 for g in gpus_per_node):
        return PlacementPlan(
            "PACK", ({"GPU": 1, "CPU": 1}, {"GPU": 1, "CPU": 1}), True, "one node, two GPUs (one each)"
        )
    if sum(1 for g in gpus_per_node if g >= 1) >= 2:
        return PlacementPlan(
            "STRICT_SPREAD", ({"GPU": 1, "CPU": 1}, {"GPU": 1, "CPU": 1}), True, "two nodes, one GPU each"
        )
    if placement == "auto":
        return _colocated()
    raise PlacementError(
        f"placement: separate needs a GPU each for the draft and target, but the cluster has {total} GPU(s) "
        f"across {len(alive)} node(s); add a GPU node, set `placement: colocated` to share the one GPU, or set "
        f"`device: cpu` in the model config to run both on CPU"
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
