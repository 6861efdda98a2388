"""Wait until a Ray cluster has at least N GPUs on live nodes; exit 0 then, 1 on timeout.

`duospec serve --address ...` fails fast when the cluster has too few GPUs for the draft/target
placement. On a fresh `ray up` the GPU workers join minutes after the head, so the head's start
command (deploy/cluster*.yaml) runs this first:

    python deploy/wait_for_gpus.py --address auto --gpus 2 --timeout 1800 && duospec serve ...

With --json it prints the live nodes as JSON on stdout (`[{"node_id", "address", "gpus"}]`), which
is handy when checking where actors landed. Progress and errors go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="auto", help="Ray cluster address (HOST:PORT or auto)")
    parser.add_argument("--gpus", type=float, default=2.0, help="GPUs needed (default 2: draft + target)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait (default 1800)")
    parser.add_argument("--poll", type=float, default=5.0, help="seconds between checks (default 5)")
    parser.add_argument("--json", action="store_true", help="print the live nodes as JSON when done")
    return parser


def live_nodes(ray_nodes: list[dict]) -> list[dict]:
    """The live entries of `ray.nodes()`, reduced to what an operator needs."""
    return [
        {
            "node_id": node["NodeID"],
            "address": node.get("NodeManagerAddress", ""),
            "gpus": float(node.get("Resources", {}).get("GPU", 0.0)),
        }
        for node in ray_nodes
        if node.get("Alive")
    ]


def wait_for_gpus(ray, needed: float, timeout_s: float, poll_s: float) -> tuple[bool, list[dict]]:
    deadline = time.monotonic() + timeout_s
    reported = -1.0
    while True:
        nodes = live_nodes(ray.nodes())
        have = sum(node["gpus"] for node in nodes)
        if have >= needed:
            return True, nodes
        if have != reported:
            print(f"wait_for_gpus: {have:g} of {needed:g} GPUs on {len(nodes)} live node(s); waiting",
                  file=sys.stderr, flush=True)
            reported = have
        if time.monotonic() >= deadline:
            return False, nodes
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import ray

    try:
        ray.init(address=args.address, log_to_driver=False, logging_level="ERROR", configure_logging=False)
    except (ConnectionError, RuntimeError) as exc:
        print(f"wait_for_gpus: no Ray cluster reachable at --address {args.address}: {exc}", file=sys.stderr)
        return 1
    try:
        ok, nodes = wait_for_gpus(ray, args.gpus, args.timeout, args.poll)
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps(nodes))
    if not ok:
        have = sum(node["gpus"] for node in nodes)
        print(
            f"wait_for_gpus: only {have:g} of {args.gpus:g} GPUs joined within {args.timeout:g} s; "
            "check `ray status` on the head and the GPU node type's min_workers/max_workers",
            file=sys.stderr,
        )
        return 1
    print(f"wait_for_gpus: {args.gpus:g} GPUs ready on {len(nodes)} live node(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
