"""Micro-benchmark: the lean engine's forward with each fixed CPU GEMM kernel against the kernels it
measures at load (duospec/engine/cpu_linear.py), same weights, one torch thread, interleaved.

    .venv/bin/python benchmarks/cpu_kernels.py                       # the bundled target
    .venv/bin/python benchmarks/cpu_kernels.py --model models/draft --rows 1 2 5

One engine per policy is loaded, each prefilled with the same --context tokens. Steps of --rows
tokens run in blocks: --block consecutive steps on one engine (each rolled back, so all see the same
context), then a block on the next, round after round, so every policy meets the same machine drift
and, within a block, finds its own weights where its previous step left them, as a worker's
engine does (the first step of each block, after another engine's, is not counted). Prints the median
forward time per policy and row count, and the ratio of the measured choice to the best fixed one.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=pathlib.Path, default=ROOT / "models" / "target")
    p.add_argument("--context", type=int, default=128, help="prefilled positions before each step")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 8], help="tokens per step")
    p.add_argument("--rounds", type=int, default=8, help="blocks per policy and row count")
    p.add_argument("--block", type=int, default=6, help="consecutive steps per block (the first is not counted)")
    p.add_argument("--max-context", type=int, default=2048, help="KV positions per slot, as a worker sizes it")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    from duospec.engine import SlotChunk, cpu_linear, load_model

    if not cpu_linear.packed_linear_works():
        raise SystemExit("oneDNN's packed linear is not available in this torch build: nothing to compare")
    kernel, measured = cpu_linear.Kernel, cpu_linear.kernel_choices
    buckets = len(cpu_linear.CALIBRATE_ROWS)
    policies = {"F.linear": (kernel.PLAIN,) * buckets, "transposed": (kernel.TRANSPOSED,) * buckets,
                "oneDNN": (kernel.ONEDNN,) * buckets, "measured": None}
    engines = {}
    prompt = [5 + i % 100 for i in range(args.context)]
    try:
        for name, fixed in policies.items():
            cpu_linear.kernel_choices = measured if fixed is None else (lambda *shape, fixed=fixed: fixed)
            runner = load_model(args.model, max_slots=1, max_context=args.max_context, backend="lean",
                                dtype="float32")
            slot = runner.allocate_slot()
            runner.forward_last([SlotChunk(slot, 0, prompt)])
            engines[name] = (runner, slot)
    finally:
        cpu_linear.kernel_choices = measured
    runner = engines["measured"][0]
    print(f"model: {args.model}; context {args.context}; fp32, 1 thread, median of "
          f"{args.rounds} x {args.block - 1} steps in blocks of {args.block}")
    for name, linear in [("lm_head", runner.lm_head)] + [(part, getattr(runner.layers[0], part))
                                                         for part in ("qkv", "o", "gate_up", "down")]:
        picks = ", ".join(f"{r}: {k.name}" for r, k in zip(cpu_linear.CALIBRATE_ROWS, linear.choices))
        print(f"  measured kernels, {name} {linear.shape}: {picks}")
    print(f"{'rows':>4} " + " ".join(f"{name:>11}" for name in engines) + "  measured/best fixed")
    for rows in args.rows:
        step = [7 + i for i in range(rows)]
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, (engine, slot) in engines.items():
                for i in range(args.block):
                    start = time.perf_counter()
                    if rows == 1:
                        engine.forward_last([SlotChunk(slot, args.context, step)])
                    else:
                        engine.forward([SlotChunk(slot, args.context, step)])
                    elapsed = time.perf_counter() - start
                    engine.truncate(slot, args.context)
                    if i:  # the block's first step follows another engine's
                        times[name].append(elapsed)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        best_fixed = min(v for k, v in med.items() if k != "measured")
        print(f"{rows:>4} " + " ".join(f"{v:>9.2f}ms" for v in med.values()) + f"  {med['measured'] / best_fixed:.2f}")


if __name__ == "__main__":
    main()
