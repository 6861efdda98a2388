"""Run as a subprocess by tests/actors/test_placement.py: a private multi-node Ray cluster on this machine
(ray.cluster_utils.Cluster), so the test run's own Ray instance is left alone.

    placement_scenarios.py TARGET DRAFT          the pair's placements
    placement_scenarios.py TARGET DRAFT tp       tensor-parallel groups and replicas (TARGET: 4 KV heads)

Prints one JSON line per scenario."""

from __future__ import annotations

import json
import sys
import time

import ray
from ray.cluster_utils import Cluster

from duospec.cluster.actors import launch_pair
from duospec.cluster.placement import PlacementError


def main(target: str, draft: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    ray.init(address=cluster.address, namespace="duospec", log_to_driver=False)
    try:
        # 1. Two nodes with one GPU each: STRICT_SPREAD, one actor per node.
        a = cluster.add_node(num_cpus=1, num_gpus=1)
        b = cluster.add_node(num_cpus=1, num_gpus=1)
        cluster.wait_for_nodes()
        pair = launch_pair("spread", target, draft, placement_timeout_s=60)
        print(json.dumps({"scenario": "two_nodes", "draft": pair.draft_info, "target": pair.target_info}), flush=True)
        pair.shutdown()
        cluster.remove_node(a)
        cluster.remove_node(b)
        # 2. One node with two GPUs: both actors there, different GPU ids.
        c = cluster.add_node(num_cpus=2, num_gpus=2)
        cluster.wait_for_nodes()
        time.sleep(1)
        pair = launch_pair("packed", target, draft, placement_timeout_s=60)
        print(json.dumps({"scenario": "one_node", "draft": pair.draft_info, "target": pair.target_info}), flush=True)
        pair.shutdown()
        cluster.remove_node(c)
        # 3. One GPU in the whole cluster: placement auto shares it (colocated, fractional GPUs) ...
        cluster.add_node(num_cpus=2, num_gpus=1)
        cluster.wait_for_nodes()
        time.sleep(1)
        pair = launch_pair("shared", target, draft, placement_timeout_s=60)
        print(json.dumps({"scenario": "colocated", "draft": pair.draft_info, "target": pair.target_info,
                          "available_gpu": ray.available_resources().get("GPU", 0.0)}), flush=True)
        pair.shutdown()
        # ... and placement separate is a clear error at once, not a hang.
        refusal("one_gpu", "short", target, draft, placement="separate")
    finally:
        ray.shutdown()
        cluster.shutdown()


def refusal(scenario: str, model: str, target: str, draft: str, **options) -> None:
    """Prints the PlacementError a launch that cannot be placed raises, and how long it took."""
    started = time.monotonic()
    try:
        launch_pair(model, target, draft, placement_timeout_s=60, **options)
        result = {"scenario": scenario, "error": None}
    except PlacementError as exc:
        result = {"scenario": scenario, "error": str(exc), "seconds": time.monotonic() - started}
    print(json.dumps(result), flush=True)


def tensor_parallel(target: str, draft: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    ray.init(address=cluster.address, namespace="duospec", log_to_driver=False)
    try:
        # 1. One 8-GPU node: a TP=4 target and a TP=1 draft, every rank on its own GPU of that node.
        cluster.add_node(num_cpus=8, num_gpus=8)
        cluster.wait_for_nodes()
        first = launch_pair("big", target, draft, target_tp=4, placement_timeout_s=60, load_timeout_s=240)
        print(json.dumps({"scenario": "tp4_one_node", "target": first.target_info, "draft": first.draft_info}),
              flush=True)
        # 2. A second replica of it: no room for its target's four ranks beside the first, so another node.
        cluster.add_node(num_cpus=8, num_gpus=8)
        cluster.wait_for_nodes()
        second = launch_pair("big", target, draft, target_tp=4, replica=1, placement_timeout_s=60,
                             load_timeout_s=240)
        print(json.dumps({"scenario": "tp4_second_replica", "target": second.target_info,
                          "draft": second.draft_info}), flush=True)
        for pair in (first, second):
            pair.shutdown()
        # 3. A group no node holds: refused at once, naming the nodes' sizes.
        refusal("tp16_refused", "huge", target, draft, target_tp=16)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    (tensor_parallel if sys.argv[3:] == ["tp"] else main)(sys.argv[1], sys.argv[2])
