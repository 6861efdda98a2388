"""What a tensor-parallel target costs (issue 34): `off` tokens/s through the server with the bundled
target at tensor-parallel size 1 and 2, side by side in one run.

    python benchmarks/tensor_parallel.py                   # 1 and 4 streams, 64 new tokens, 3 rounds
    python benchmarks/tensor_parallel.py --streams 1 8 --rounds 5

One server holds both models (a TP=1 and a TP=2 target of the same checkpoint, each with the bundled
draft, unused in `off`); each round runs every stream count on TP=1 and then on TP=2, so the machine's
drift hits both alike, and the table gives medians over the rounds. On CPU the ranks are processes
joined by gloo and share the machine's cores with each other: the figure measures what the
collectives cost (a forward's all-reduces and the broadcast that sends the ranks rank 0's calls),
not a speed-up. On GPUs (NCCL) run it with --device cuda.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
SIZES = (1, 2)


async def measure(pairs: dict, prompts, streams: list[int], rounds: int, max_new_tokens: int) -> dict:
    """{(tp, streams): [aggregate tokens/s per round]}."""
    from duospec.bench.served import served_pipelines, sweep_point
    from duospec.coordinator.config import SpeculationDefaults

    results: dict[tuple[int, int], list[float]] = {}
    async with served_pipelines(pairs, SpeculationDefaults(), None) as served:
        for name in pairs:  # warm-up: every rank has run a forward
            await sweep_point(served[name], prompts, "off", 1, 1, 8, lambda: None)
        for r in range(rounds):
            for n in streams:
                for tp, name in zip(SIZES, pairs):
                    point = await sweep_point(served[name], prompts, "off", n, 2, max_new_tokens, lambda: None)
                    results.setdefault((tp, n), []).append(point["aggregate_tokens_per_s"])
            print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)

    from duospec.bench.inprocess import BenchPair, encode_prompts
    from duospec.bench.prompts import load_prompts
    from duospec.cluster.runtime import connect
    from duospec.engine import load_tokenizer

    models = REPO / "models"
    prompts = encode_prompts(load_tokenizer(str(models / "target")), load_prompts(), 256)
    # On GPUs each pair's draft shares its target's first GPU (colocated): TP=1 and TP=2 side by side
    # take 3 GPUs.
    placement = "colocated" if args.device == "cuda" else "auto"
    pairs = {f"tp{tp}": BenchPair(str(models / "target"), str(models / "draft"), device=args.device,
                                  placement=placement, tensor_parallel_size=tp) for tp in SIZES}
    if args.device == "cpu":  # 1 + 2 target ranks and two drafters: logical CPUs past the cores are fine
        connect(None, num_cpus=2 + sum(SIZES) * 2)
    results = asyncio.run(measure(pairs, prompts, args.streams, args.rounds, args.max_new_tokens))
    print(f"`off` through the server, bundled target, {args.max_new_tokens} new tokens, {args.device}, "
          f"{os.cpu_count()} cores, median of {args.rounds} rounds")
    print("| streams | TP=1 tokens/s | TP=2 tokens/s | TP=2 / TP=1 |")
    print("|---:|---:|---:|---:|")
    for n in args.streams:
        one, two = (statistics.median(results[(tp, n)]) for tp in SIZES)
        print(f"| {n} | {one:.0f} | {two:.0f} | {two / one:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
