"""Issue 4's measurement: our three modes in-process vs through the Ray actors (gRPC data plane).

    .venv/bin/python benchmarks/pipeline_bench.py                         # bundled pair, 128 tokens
    .venv/bin/python benchmarks/pipeline_bench.py --models DIR --out OUT  # another pair

Greedy, the documented prompt set, off / vanilla / pearl, each path repeated. Prints tokens/s, mean
accepted length and both actors' busy fractions, plus the overhead per verify round, and writes the
usual results.{md,json,png}. A preset of `duospec bench` (no transformers baselines, no sweep).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # run from a checkout without installing


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=pathlib.Path, default=pathlib.Path(os.environ.get("DUOSPEC_MODELS", REPO_ROOT / "models")),
                   help="folder with target/ and draft/ (default: the bundled pair)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--limit-prompts", type=int, help="first N prompts only")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench-out/pipeline"))
    p.add_argument("--address", help="Ray cluster to join (default: a local Ray)")
    return p.parse_args()


def main() -> int:
    from duospec.bench import BenchConfig, run_bench, write_outputs

    args = parse_args()
    config = BenchConfig(target=str(args.models / "target"), draft=str(args.models / "draft"), out=args.out,
                         prompt_limit=args.limit_prompts, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                         modes=("off", "vanilla", "pearl"), concurrency=(), ray_address=args.address,
                         models_label=f"pair in {args.models}")
    try:
        config.validate()
    except (ValueError, FileNotFoundError) as exc:
        print(f"pipeline_bench: error: {exc}", file=sys.stderr)
        return 2
    report = run_bench(config)
    write_outputs(report, args.out)
    print(f"{'path':<11} {'mode':<8} {'tokens/s':>9} {'accepted len':>13} {'target busy':>12} {'draft busy':>11}")
    for path, block in report["paths"].items():
        for mode, s in block["modes"].items():
            mal = f"{s['mean_accepted_length']:.2f}" if s["mean_accepted_length"] else "-"
            busy = [f"{s[k] * 100:.0f} %" if s[k] is not None else "-"
                    for k in ("target_busy_fraction", "draft_busy_fraction")]
            print(f"{path:<11} {mode:<8} {s['tokens_per_s']:>9.1f} {mal:>13} {busy[0]:>12} {busy[1]:>11}")
    for o in report["overhead"]:
        print(f"overhead per verify round ({o['path']}): {o['overhead_per_round_s'] * 1e3:.3f} ms "
              f"(wall {o['wall_per_round_s'] * 1e3:.3f} ms - target {o['target_per_round_s'] * 1e3:.3f} ms)")
    print(f"wrote {args.out}/results.md, results.json, results.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
