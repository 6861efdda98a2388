"""Are this machine's cores independent? The target's decode step alone and beside a busy neighbour.

    .venv/bin/python benchmarks/core_contention.py --target ~/.cache/duospec/models/smollm2-135m-instruct \
        --draft models/smollm2/draft

Pearl assumes the drafter works while the target verifies at no cost to the target (separate
devices). On CPU cores that share execution units or memory bandwidth that does not hold. This
times the target's single-token decode step (one thread, duospec's engine; median of `--repeats`)
with the other core idle, then beside a neighbour process of each kind: `alu` (a small matmul loop
that stays in L1: shared execution units), `mem` (a 256 MB copy loop: shared memory bandwidth) and
`draft` (the draft model drafting, as pearl's drafter does), then idle again.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

NEIGHBOURS = ("alu", "mem", "draft")


def _neighbour(kind: str, draft: str) -> None:
    import torch

    torch.set_num_threads(1)
    if kind == "draft":
        from duospec.draft_worker.proposer import DraftSpec
        from duospec.engine import load_model
        from duospec.training.acceptance import runner_step_seconds

        runner = load_model(draft, device="cpu", dtype=torch.float32, max_slots=1, drafter=True,
                            float16_products=DraftSpec.float16_products)
        while True:
            runner_step_seconds(runner, 64, 50)
    elif kind == "alu":
        a = torch.randn(48, 48)
        while True:
            a = torch.tanh(a @ a)
    else:
        a, b = torch.randn(64 << 20), torch.empty(64 << 20)
        while True:
            b.copy_(a)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=os.path.expanduser("~/.cache/duospec/models/smollm2-135m-instruct"))
    parser.add_argument("--draft", default="models/smollm2/draft")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--neighbour", choices=NEIGHBOURS, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args(argv)
    if args.neighbour:
        _neighbour(args.neighbour, args.draft)
        return 0
    import torch

    from duospec.engine import load_model
    from duospec.training.acceptance import runner_step_seconds

    torch.set_num_threads(1)
    target = load_model(args.target, device="cpu", dtype=torch.float32, max_slots=1)
    alone = None
    for kind in ("none", *NEIGHBOURS, "none"):
        child = None
        if kind != "none":
            child = subprocess.Popen([sys.executable, __file__, "--neighbour", kind, "--draft", args.draft])
            time.sleep(4)  # loaded and busy
        step = runner_step_seconds(target, 64, args.repeats)
        alone = alone or step
        print(f"other core {'idle' if kind == 'none' else 'busy: ' + kind:<12} target step {step * 1e3:6.1f} ms "
              f"({step / alone:.2f}x alone)", flush=True)
        if child is not None:
            child.kill()
            child.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
