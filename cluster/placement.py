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

Tensor parallelism (models[].tensor_parallel_size, draft.tensor_parallel_size > 1): a worker is a group
of one actor per rank (cluster/tp_group.py), all on one node. Each group gets its own placement group,
one {GPU: 1, CPU: 1} bundle per rank ({CPU: 1} on a CPU cluster), STRICT_PACK; the target's is reserved
first (the larger), so the draft's lands on the same node's other GPUs or on another node. A group that
no node can hold is refused at once, naming the nodes' sizes.

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
class GroupPlan:
    """One Ray placement group."""

    name: str  # the group's suffix: "pair" (both workers in one group), "target" or "draft"
    strategy: str  # a Ray placement-group strategy
    bundles: tuple[dict, ...]  # what it reserves


@dataclass(frozen=True)
class ActorSlot:
    """Where one actor runs: a bundle of one of the plan's placement groups, and what it asks of it."""

    group: int  # index in PlacementPlan.groups
    bundle: int
    resources: dict  # {"CPU": .., "GPU": ..}


@dataclass(frozen=True)
class PlacementPlan:
    groups: tuple[GroupPlan, ...]  # reserved in this order
    uses_gpu: bool
    description: str
    target: tuple[ActorSlot, ...]  # one per rank, rank 0 first
    draft: tuple[ActorSlot, ...]

    @property
    def colocated(self) -> bool:
        """Draft and target share one bundle (one GPU's memory)."""
        return (self.draft[0].group, self.draft[0].bundle) == (self.target[0].group, self.target[0].bundle)


def _pair(strategy: str, draft: dict, target: dict, uses_gpu: bool, description: str) -> PlacementPlan:
    """Both rank-0 workers in one placement group, a bundle each."""
    return PlacementPlan((GroupPlan("pair", strategy, (draft, target)),), uses_gpu, description,
                         target=(ActorSlot(0, 1, target),), draft=(ActorSlot(0, 0, draft),))


def _colocated() -> PlacementPlan:
    return PlacementPlan(
        (GroupPlan("pair", "PACK", ({"GPU": 1, "CPU": 2},)),), True,
        f"both on one GPU (colocated: target {TARGET_GPU_SHARE:g}, draft {1 - TARGET_GPU_SHARE:g} of it)",
        target=(ActorSlot(0, 0, {"GPU": TARGET_GPU_SHARE, "CPU": 1}),),
        draft=(ActorSlot(0, 0, {"GPU": 1 - TARGET_GPU_SHARE, "CPU": 1}),),
    )


def plan_placement(nodes: list[dict], *, use_gpu: bool | None = None, draft_needs_gpu: bool = True,
                   placement: str = "auto", target_tp: int = 1, draft_tp: int = 1) -> PlacementPlan:
    """Pure: decides the placement from `ray.nodes()`-style dicts (Alive, Resources).
    `draft_needs_gpu=False`: the drafter loads no model (n-gram); only the target asks for a GPU.
    `placement`: auto | separate | colocated (module docstring). `target_tp` / `draft_tp`: ranks of
    each worker's tensor-parallel group."""
    if placement not in PLACEMENTS:
        raise ValueError(f"placement={placement!r}: use one of {', '.join(PLACEMENTS)}")
    alive = [n for n in nodes if n.get("Alive", n.get("alive", True))]
    gpus_per_node = [int(n.get("Resources", {}).get("GPU", 0)) for n in alive]
    total = sum(gpus_per_node)
    if use_gpu is None:
        use_gpu = total > 0
    if target_tp > 1 or draft_tp > 1:
        return _plan_groups(alive, use_gpu, draft_needs_gpu, placement, target_tp, draft_tp)
    if not use_gpu:
        return _pair("PACK", {"CPU": 1}, {"CPU": 1}, False, "CPU only: two 1-CPU actors")
    if total < 1:
        raise PlacementError(
            f"the target needs a GPU, but the cluster has none across {len(alive)} node(s); add a GPU "
            f"node, or set `device: cpu` in the model config"
        )
    if not draft_needs_gpu:
        return _pair("PACK", {"CPU": 1}, {"GPU": 1, "CPU": 1}, True, "target on one GPU, model-free drafter on a CPU")
    if placement == "colocated":
        return _colocated()
    if any(g >= 2 for g in gpus_per_node):
        return _pair("PACK", {"GPU": 1, "CPU": 1}, {"GPU": 1, "CPU": 1}, True, "one node, two GPUs (one each)")
    if sum(1 for g in gpus_per_node if g >= 1) >= 2:
        return _pair("STRICT_SPREAD", {"GPU": 1, "CPU": 1}, {"GPU": 1, "CPU": 1}, True, "two nodes, one GPU each")
    if placement == "auto":
        return _colocated()
    raise PlacementError(
        f"placement: separate needs a GPU each for the draft and target, but the cluster has {total} GPU(s) "
        f"across {len(alive)} node(s); add a GPU node, set `placement: colocated` to share the one GPU, or set "
        f"`device: cpu` in the model config to run both on CPU"
    )


def _plan_groups(alive: list[dict], use_gpu: bool, draft_needs_gpu: bool, placement: str, target_tp: int,
                 draft_tp: int) -> PlacementPlan:
    """A placement group per worker, one bundle per rank, each packed on one node (module docstring)."""
    unit = "GPU" if use_gpu else "CPU"
    if placement == "colocated":
        raise PlacementError(
            f"placement: colocated shares one GPU between the draft and the target, but a tensor-parallel group "
            f"(tensor_parallel_size {max(target_tp, draft_tp)}) needs a {unit} per rank; use placement: auto or separate")
    rank = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
    draft_rank = rank if draft_needs_gpu else {"CPU": 1}
    sizes = [int(n.get("Resources", {}).get(unit, 0)) for n in alive]
    draft_units = draft_tp if draft_rank.get(unit) else 0
    _check_groups_fit(sizes, unit, target_tp, draft_units)
    groups = [GroupPlan("target", "STRICT_PACK", (rank,) * target_tp)]
    target = tuple(ActorSlot(0, r, rank) for r in range(target_tp))
    groups.append(GroupPlan("draft", "STRICT_PACK", (draft_rank,) * draft_tp))
    draft = tuple(ActorSlot(1, r, draft_rank) for r in range(draft_tp))
    description = (f"target: {target_tp} rank(s) on one node, a {unit} each; draft: {draft_tp} rank(s) on one node "
                   f"({'a ' + unit if draft_rank.get(unit) else 'a CPU'} each)")
    return PlacementPlan(tuple(groups), use_gpu, description, target=target, draft=draft)


def _check_groups_fit(sizes: list[int], unit: str, target_units: int, draft_units: int) -> None:
    """PlacementError unless a node holds the target's group and the draft's fits beside it (on the
    same node or another)."""
    nodes = f"{', '.join(str(s) for s in sorted(sizes, reverse=True)) or 'no'} {unit}s" if sizes else f"no {unit}s"
    homes = [i for i, s in enumerate(sizes) if s >= target_units]
    if not homes:
        raise PlacementError(
            f"the target's tensor-parallel group needs {target_units} {unit}s on one node (one per rank), but no "
            f"node has that many (the nodes have {nodes}); add a node with at least {target_units} {unit}s or lower "
            f"models[].tensor_parallel_size")
    for i in homes:
        left = [s - target_units if j == i else s for j, s in enumerate(sizes)]
        if max(left) >= draft_units:
            return
    raise PlacementError(
        f"the target's tensor-parallel group takes {target_units} {unit}s of one node, and the draft's group of "
        f"{draft_units} then fits on no node (the nodes have {nodes}); add a node with at least {draft_units} "
        f"{unit}s or lower draft.tensor_parallel_size")


def create_placement_groups(plan: PlacementPlan, *, name: str, timeout_s: float = 30.0) -> tuple:
    """Reserves the plan's groups, in order; raises PlacementError (and frees what it reserved) if one
    cannot be placed within `timeout_s` (an autoscaling cluster adds a node for a pending group
    meanwhile: give it the time a node takes to start)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    reserved = []
    for group_plan in plan.groups:
        label = name if group_plan.name == "pair" else f"{name}-{group_plan.name}"
        group = placement_group(list(group_plan.bundles), strategy=group_plan.strategy, name=label)
        reserved.append(group)
        ready, _ = ray.wait([group.ready()], timeout=timeout_s)
        if not ready:
            for g in reserved:
                remove_placement_group(g)
            raise PlacementError(
                f"could not place the {'draft and target' if group_plan.name == 'pair' else group_plan.name} "
                f"({plan.description}: bundles {list(group_plan.bundles)}, strategy {group_plan.strategy}) within "
                f"{timeout_s:.0f} s; the cluster lacks free resources — check `ray status`"
            )
    return tuple(reserved)
