"""Run as a subprocess by tests/test_placement.py: a private multi-node Ray cluster on this machine
(ray.cluster_utils.Cluster), so the test session's own Ray instance is left alone.

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
        started = time.monotonic()
        try:
            launch_pair("short", target, draft, placement_timeout_s=60, placement="separate")
            result = {"scenario": "one_gpu", "error": None}
        except PlacementError as exc:
            result = {"scenario": "one_gpu", "error": str(exc), "seconds": time.monotonic() - started}
        print(json.dumps(result), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
