"""Placement of the draft and target actors on different GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from duospec.cluster.placement import PlacementError, plan_placement
from tiny_models import make_tiny_checkpoint


def _node(gpus: int, alive: bool = True) -> dict:
    return {"Alive": alive, "Resources": {"CPU": 4.0, **({"GPU": float(gpus)} if gpus else {})}}


def test_plan_one_node_two_gpus_packs_two_gpu_bundles():
    plan = plan_placement([_node(2)])
    (group,) = plan.groups
    assert group.strategy == "PACK" and plan.uses_gpu
    assert all(b["GPU"] == 1 for b in group.bundles)


def test_plan_one_gpu_per_node_spreads():
    plan = plan_placement([_node(0), _node(1), _node(1)])
    assert [g.strategy for g in plan.groups] == ["STRICT_SPREAD"]


def test_plan_cpu_only_cluster_uses_cpu_bundles():
    plan = plan_placement([_node(0)])
    assert not plan.uses_gpu and all("GPU" not in b for g in plan.groups for b in g.bundles)


def test_plan_single_gpu_separate_is_a_clear_error():
    with pytest.raises(PlacementError, match="separate needs a GPU each.*1 GPU.*placement: colocated"):
        plan_placement([_node(1), _node(0), _node(1, alive=False)], placement="separate")


def test_plan_single_gpu_auto_colocates_both_actors_on_it():
    plan = plan_placement([_node(1), _node(0), _node(1, alive=False)])
    assert plan.colocated and plan.uses_gpu and [g.bundles for g in plan.groups] == [({"GPU": 1, "CPU": 2},)]
    (draft,), (target,) = plan.draft, plan.target
    assert draft.resources["GPU"] + target.resources["GPU"] == 1 and target.resources["GPU"] > draft.resources["GPU"] > 0
    assert (draft.group, draft.bundle) == (target.group, target.bundle) == (0, 0)


def test_plan_colocated_on_request_even_with_two_gpus():
    assert plan_placement([_node(2)], placement="colocated").colocated
    assert not plan_placement([_node(2)]).colocated
    assert not plan_placement([_node(2)], placement="colocated", use_gpu=False).colocated  # CPU: two 1-CPU actors


def test_plan_unknown_placement_is_refused():
    with pytest.raises(ValueError, match="placement='both'"):
        plan_placement([_node(2)], placement="both")


def test_plan_device_cpu_ignores_gpus():
    assert not plan_placement([_node(2)], use_gpu=False).uses_gpu


@pytest.mark.ray
@pytest.mark.slow  # a private Ray cluster per scenario: about a minute (make test-slow, and CI, run it)
@pytest.mark.timeout(900)  # the scenarios' subprocess may take up to 420 s, past the global 300 s
def test_actors_land_on_different_nodes_and_gpus(tmp_path):
    target = make_tiny_checkpoint(tmp_path / "target", "llama", seed=1)
    draft = make_tiny_checkpoint(tmp_path / "draft", "llama", seed=2, hidden_size=32, num_layers=1)
    env = {**os.environ, "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(os.path.dirname(__file__)), "placement_scenarios.py"), str(target), str(draft)],
        capture_output=True,
        text=True,
        timeout=420,
        env=env,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    results = {r["scenario"]: r for r in lines}
    assert set(results) == {"two_nodes", "one_node", "colocated", "one_gpu"}, proc.stderr[-3000:]
    two = results["two_nodes"]
    assert two["draft"]["node_id"] != two["target"]["node_id"]
    one = results["one_node"]
    assert one["draft"]["node_id"] == one["target"]["node_id"]
    assert one["draft"]["gpu_ids"] and one["target"]["gpu_ids"]
    assert one["draft"]["gpu_ids"] != one["target"]["gpu_ids"]
    shared = results["colocated"]
    assert shared["draft"]["node_id"] == shared["target"]["node_id"]
    assert shared["draft"]["gpu_ids"] and shared["draft"]["gpu_ids"] == shared["target"]["gpu_ids"]
    assert shared["available_gpu"] == 0.0  # the pair holds the node's one GPU between them
    # sharing one GPU's memory, the target starts loading only once the draft holds its KV cache, so
    # its free-memory check sees the draft's share (started together, both would see it all free)
    assert shared["target"]["started_at"] >= shared["draft"]["loaded_at"]
    short = results["one_gpu"]
    assert short["error"] and "GPU" in short["error"] and short["seconds"] < 10


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tensor_parallel_groups_land_one_rank_per_gpu_on_one_node(tmp_path):
    """Logical GPUs on a private Ray Cluster: a TP=4 target and a TP=1 draft on one 8-GPU node; a second
    replica's target group on the other node; a group that no node holds refused at once."""
    target = make_tiny_checkpoint(tmp_path / "target", "llama", seed=1, num_heads=4, num_kv_heads=4)
    draft = make_tiny_checkpoint(tmp_path / "draft", "llama", seed=2, hidden_size=32, num_layers=1)
    proc = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(os.path.dirname(__file__)), "placement_scenarios.py"), str(target), str(draft),
         "tp"], capture_output=True, text=True, timeout=600, env={**os.environ, "RAY_DEDUP_LOGS": "0"})
    results = {r["scenario"]: r for r in (json.loads(line) for line in proc.stdout.splitlines()
                                          if line.startswith("{"))}
    assert set(results) == {"tp4_one_node", "tp4_second_replica", "tp16_refused"}, proc.stderr[-3000:]

    def ranks(info):  # (node, GPU ids) of every rank of a worker
        return [(info["node_id"], tuple(info["gpu_ids"]))] + [(r["node_id"], tuple(r["gpu_ids"])) for r in info["ranks"]]

    one = results["tp4_one_node"]
    target, draft = ranks(one["target"]), ranks(one["draft"])
    assert one["target"]["tensor_parallel_size"] == 4 and len(target) == 4 and len(draft) == 1
    assert len({node for node, _ in target + draft}) == 1  # all on the 8-GPU node
    gpus = [g for _, ids in target + draft for g in ids]
    assert len(gpus) == 5 and len(set(gpus)) == 5  # a GPU each
    second = ranks(results["tp4_second_replica"]["target"])
    assert len({node for node, _ in second}) == 1 and second[0][0] != target[0][0]
    refused = results["tp16_refused"]
    assert refused["error"] and "needs 16 GPUs on one node" in refused["error"] and "the nodes have 8, 8, 0 GPUs" in refused["error"]
    assert refused["seconds"] < 10


def test_plan_model_free_drafter_needs_only_the_targets_gpu():
    plan = plan_placement([_node(1)], draft_needs_gpu=False)
    draft, target = plan.groups[0].bundles
    assert plan.uses_gpu and target["GPU"] == 1 and "GPU" not in draft
    with pytest.raises(PlacementError, match="the target needs a GPU"):
        plan_placement([_node(0)], use_gpu=True, draft_needs_gpu=False)


def test_a_worker_pairs_repr_hides_the_deployment_secret_and_the_tls_key():
    """A pair printed in a log line or an error names its model and endpoints, never its secrets."""
    from duospec.cluster.actors import WorkerPair
    from duospec.cluster.secret import InternalTls, new_deployment_secret

    secret = new_deployment_secret()
    tls = InternalTls(b"CERT", b"-----BEGIN PRIVATE KEY-----", b"CA")
    pair = WorkerPair("m", None, None, None, {"endpoint": "10.0.0.1:7001"}, None, secret, tls)
    text = repr(pair)
    assert "10.0.0.1:7001" in text and secret not in text and "PRIVATE" not in text


def test_plan_tensor_parallel_target_and_draft_pack_each_group_on_one_node():
    plan = plan_placement([_node(8)], target_tp=4, draft_tp=1)
    target, draft = plan.groups
    assert (target.name, target.strategy, target.bundles) == ("target", "STRICT_PACK", ({"GPU": 1, "CPU": 1},) * 4)
    assert (draft.name, draft.strategy, draft.bundles) == ("draft", "STRICT_PACK", ({"GPU": 1, "CPU": 1},))
    assert [(s.group, s.bundle) for s in plan.target] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert [(s.group, s.bundle) for s in plan.draft] == [(1, 0)] and not plan.colocated
    # two-GPU nodes: the target's pair on one, the draft's on the other
    assert len(plan_placement([_node(2), _node(2)], target_tp=2, draft_tp=2).groups) == 2
    cpu = plan_placement([_node(0)], use_gpu=False, target_tp=2)
    assert [g.bundles for g in cpu.groups] == [({"CPU": 1},) * 2, ({"CPU": 1},)]


def test_plan_a_group_no_node_holds_is_refused_naming_the_node_sizes():
    with pytest.raises(PlacementError, match=r"needs 4 GPUs on one node .*the nodes have 2, 2, 1 GPUs.*"
                                             r"at least 4 GPUs or lower models\[\]\.tensor_parallel_size"):
        plan_placement([_node(2), _node(1), _node(2)], target_tp=4)
    with pytest.raises(PlacementError, match=r"the draft's group of 2 then fits on no node .*4, 1 GPUs"):
        plan_placement([_node(4), _node(1)], target_tp=4, draft_tp=2)
    with pytest.raises(PlacementError, match="colocated shares one GPU.*use placement: auto or separate"):
        plan_placement([_node(4)], target_tp=2, placement="colocated")
    # a model-free drafter needs no GPU beside the target's group
    plan = plan_placement([_node(4)], target_tp=4, draft_needs_gpu=False)
    assert plan.groups[1].bundles == ({"CPU": 1},)
