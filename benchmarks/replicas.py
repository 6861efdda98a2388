"""One coordinator's ceiling (issue 34): aggregate tokens/s through the server for 1, 2 and 4 replicas of
one model, 8 client streams per replica, on SIMULATED devices.

    python benchmarks/replicas.py                      # replicas 1 2 4, pearl, 64 new tokens
    python benchmarks/replicas.py --replicas 1 2 4 8 --mode off

The workers are the replay runners of `duospec bench --simulate devices` (duospec/bench/simulate.py):
the bundled pair's recorded greedy choices, every forward sleeping for the cost measured on this
machine instead of computing, so the actors spend next to no CPU and what limits the aggregate is
what is real: the coordinator process (scheduler, gRPC streams to every worker, the server's
streams to the clients) and the actors' gRPC handling. Each replica is a draft/target pair of Ray
actors (models[].replicas); the server routes each request to the least loaded one.

Prints per replica count: aggregate tokens/s and its ratio to one replica, the verify rounds per
second the coordinator ran over all replicas, the coordinator's own work per round (applying a verdict
and sending the next batch, `verdict_handling_s`) and its share of the wall time, the CPU the
coordinator's process used (its event loop, gRPC threads, the server's streams and this benchmark's
client, which runs in it), and how busy the machine's cores were. Where rounds/s stop growing while
the process uses a whole core, one coordinator process is the bottleneck; where every core is busy,
the machine is (the actors' gRPC handling and the client compete for it too).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
STREAMS_PER_REPLICA = 8


async def measure(pair, speculation, prompts, replicas: int, mode: str, max_new_tokens: int, requests: int) -> dict:
    """One pipeline of `replicas` pairs behind the server; 8 streams per replica, `requests` each."""
    from duospec.bench.served import served_pipeline, sweep_point

    async with served_pipeline(pair, speculation, None, replicas) as s:
        await sweep_point(s, prompts, mode, 1, 1, max_new_tokens, lambda: None)  # warm-up: opens every replica
        before, cpu_before, machine_before = _totals(await s.coordinator.stats()), time.process_time(), _machine()
        point = await sweep_point(s, prompts, mode, STREAMS_PER_REPLICA * replicas, requests, max_new_tokens,
                                  lambda: None)
        after, cpu_after, machine_after = _totals(await s.coordinator.stats()), time.process_time(), _machine()
    rounds, handling, wall = after[0] - before[0], after[1] - before[1], point["wall_s"]
    busy, total = (b - a for a, b in zip(machine_before, machine_after))
    return {"replicas": replicas, "streams": point["streams"], "tokens_per_s": point["aggregate_tokens_per_s"],
            "rounds_per_s": rounds / wall, "handling_ms_per_round": 1e3 * handling / max(1, rounds),
            "handling_share": handling / wall, "process_cpu_share": (cpu_after - cpu_before) / wall,
            "machine_busy_share": busy / total if total else float("nan")}


def _machine() -> tuple[int, int]:
    """(busy, all) CPU ticks of the whole machine so far (/proc/stat), every core."""
    fields = [int(x) for x in pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _totals(stats: dict) -> tuple[int, float]:
    """(verify rounds, seconds of verdict handling) over every replica of the one model."""
    (model,) = stats["models"].values()
    replicas = model["replicas"].values() if "replicas" in model else [model]
    return (sum(r["target"]["batches"] for r in replicas), sum(r["target"]["verdict_handling_s"] for r in replicas))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--mode", default="pearl", choices=("pearl", "vanilla", "off"))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2, help="requests per stream, back to back")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="where the replay checkpoints go")
    args = parser.parse_args(argv)

    from duospec.bench.inprocess import BenchPair, encode_prompts
    from duospec.bench.prompts import load_prompts
    from duospec.bench.simulate import build_replay_pair
    from duospec.cluster.runtime import connect
    from duospec.coordinator.config import SpeculationDefaults
    from duospec.engine import load_tokenizer

    models = REPO / "models"
    speculation = SpeculationDefaults()  # what a served model gets by default
    prompts = encode_prompts(load_tokenizer(str(models / "target")), load_prompts(), 256)
    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="duospec-replicas-"))
    target, draft, simulation = build_replay_pair(
        out, str(models / "target"), str(models / "draft"), [p.token_ids for p in prompts], scenario="devices",
        max_new_tokens=args.max_new_tokens, max_draft_tokens=speculation.max_draft_tokens, gamma=speculation.gamma,
        max_lookahead=speculation.max_lookahead, progress=False)
    pair = BenchPair(str(target), str(draft))
    # a pair's two 1-CPU actors per replica; their forwards sleep, so logical CPUs past the cores are fine
    connect(None, num_cpus=2 * max(args.replicas))
    rows = [asyncio.run(measure(pair, speculation, prompts, n, args.mode, args.max_new_tokens, args.requests))
            for n in args.replicas]
    print(f"SIMULATED devices ({simulation['what'][:90]}...), mode {args.mode}, {args.max_new_tokens} new tokens, "
          f"{STREAMS_PER_REPLICA} streams per replica, {args.requests} requests each")
    print(f"{os.cpu_count()} cores; the coordinator process also runs the server and the benchmark's client")
    print("| replicas | streams | tokens/s | x one replica | verify rounds/s | verdict handling ms/round | "
          "verdict handling share | coordinator process CPU | machine CPU busy |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = rows[0]["tokens_per_s"]
    for r in rows:
        print(f"| {r['replicas']} | {r['streams']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.2f} | "
              f"{r['rounds_per_s']:.0f} | {r['handling_ms_per_round']:.2f} | {100 * r['handling_share']:.0f}% | "
              f"{100 * r['process_cpu_share']:.0f}% of a core | {100 * r['machine_busy_share']:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
