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
    assert plan.strategy == "PACK" and plan.uses_gpu
    assert all(b["GPU"] == 1 for b in plan.bundles)


def test_plan_one_gpu_per_node_spreads():
    plan = plan_placement([_node(0), _node(1), _node(1)])
    assert plan.strategy == "STRICT_SPREAD"


def test_plan_cpu_only_cluster_uses_cpu_bundles():
    plan = plan_placement([_node(0)])
    assert not plan.uses_gpu and all("GPU" not in b for b in plan.bundles)


def test_plan_single_gpu_separate_is_a_clear_error():
    with pytest.raises(PlacementError, match="separate needs a GPU each.*1 GPU.*placement: colocated"):
        plan_placement([_node(1), _node(0), _node(1, alive=False)], placement="separate")


def test_plan_single_gpu_auto_colocates_both_actors_on_it():
    plan = plan_placement([_node(1), _node(0), _node(1, alive=False)])
    assert plan.colocated and plan.uses_gpu and plan.bundles == ({"GPU": 1, "CPU": 2},)
    draft, target = plan.resources(0), plan.resources(1)
    assert draft["GPU"] + target["GPU"] == 1 and target["GPU"] > draft["GPU"] > 0
    assert plan.bundle_of == (0, 0)


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
@pytest.mark.timeout(900)  # the scenarios' subprocess may take up to 420 s, past the global 300 s
def test_actors_land_on_different_nodes_and_gpus(tmp_path):
    target = make_tiny_checkpoint(tmp_path / "target", "llama", seed=1)
    draft = make_tiny_checkpoint(tmp_path / "draft", "llama", seed=2, hidden_size=32, num_layers=1)
    env = {**os.environ, "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.run(
        [sys.executable, os.path.join(os.path.dirname(__file__), "placement_scenarios.py"), str(target), str(draft)],
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


def test_plan_model_free_drafter_needs_only_the_targets_gpu():
    plan = plan_placement([_node(1)], draft_needs_gpu=False)
    draft, target = plan.bundles
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
