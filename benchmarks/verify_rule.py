"""The verify rule for a batch: the reference item by item (`verify_each`) vs batched tensor code
(`duospec.verify.batch`), on this machine's CPU or a GPU.

    .venv/bin/python benchmarks/verify_rule.py                   # vocab 4,096 and 32,000, CPU
    .venv/bin/python benchmarks/verify_rule.py --device cuda --vocab 128256

Each item has 4 drafts: the first two the target's argmax (greedy) or drawn near it (sampled, q from
slightly perturbed logits), then two that are usually rejected. Prints the median time of each over
--repeats calls; both produce the same verdicts (checked here too).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from duospec.qcodec import DraftProbs
from duospec.sampling import SamplingParams, probs_from_logits
from duospec.verify.batch import VerifyTask, verify_batch, verify_each


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[4096, 32000])
    p.add_argument("--items", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    torch.set_num_threads(1)
    k = 4
    print(f"verify rule, {k} drafts per item, device {args.device}, median of {args.repeats} (ms)")
    print("| vocab | items | greedy: reference | greedy: batched | sampled: reference | sampled: batched |")
    print("|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for vocab in args.vocab:
        for n in args.items:
            row = []
            for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=3)):
                logits = torch.randn(n * (k + 1), vocab, generator=gen) * 3
                tasks = []
                for b in range(n):
                    rows = logits[b * (k + 1):(b + 1) * (k + 1)]
                    tokens = [int(rows[i].argmax()) if i < 2 else 5 for i in range(k)]
                    probs = None if params.greedy else [
                        DraftProbs.from_probs(probs_from_logits(rows[i:i + 1] + 0.1 * torch.randn(1, vocab), params)[0])
                        for i in range(k)]
                    tasks.append(VerifyTask(tokens, b * (k + 1), params, 100, draft_probs=probs))
                on_device = logits.to(args.device)
                if verify_each(on_device, tasks) != verify_batch(on_device, tasks):
                    raise SystemExit("verify_each and verify_batch disagree")
                for decide in (verify_each, verify_batch):
                    times = []
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        decide(on_device, tasks)
                        times.append(time.perf_counter() - t0)
                    row.append(statistics.median(times) * 1e3)
            print(f"| {vocab:,} | {n} | " + " | ".join(f"{t:.2f}" for t in row) + " |")


if __name__ == "__main__":
    main()
