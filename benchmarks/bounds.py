"""Upper bounds of pearl over `off` on a simulated run's own target cost curve.

Reads the results.json that `duospec bench --simulate ... --out DIR` writes and, for a drafter whose
drafts are accepted i.i.d. with probability a and that always keeps up, prints:
- chains of k drafts: E(a, k) t(1) / t(k + 1), best k;
- token trees that add every chain position's runner-up as a sibling, right with the run's recorded
  second-choice hit rate h where the chain stops;
- both on a flat (GPU-like) verify curve, t(n) = t(1), k <= 8;
- with STEP_MS=s, chains no longer than the drafter makes during one verify (k s <= t(k + 1)).
docs/benchmarks.md ("What bounds these figures") reads these numbers.

    [STEP_MS=1.5] python benchmarks/bounds.py RESULTS_JSON [a ...]
"""
import json
import os
import sys

import numpy as np


def main(path: str, alphas: list[float]) -> None:
    with open(path, encoding="utf-8") as f:
        run = json.load(f)["setup"]["simulation"]
    cost = run["target_cost"]

    def t(n: float) -> float:
        return float(np.interp(n, cost["tokens"], cost["seconds"]))

    h = run["second_choice_hit_rate"]
    for a in alphas:
        def chain(k: int) -> float:
            return (1 - a ** (k + 1)) / (1 - a)

        def tree(k: int) -> float:
            return chain(k) + h * sum(a ** i * (1 - a) for i in range(k))

        def best(tokens, rows, ks):
            return max((tokens(k) * t(1) / t(rows(k)), k) for k in ks)

        c = best(chain, lambda k: k + 1, range(17))
        tr = best(tree, lambda k: 2 * k + 1, range(17))
        print(f"a={a}: chains {c[0]:.2f}x (k={c[1]}), runner-up trees {tr[0]:.2f}x (k={tr[1]}); flat verify, "
              f"k <= 8: chains {chain(8):.2f}x, trees {max(tree(k) for k in range(9)):.2f}x  (h = {h:.2f})")
        if "STEP_MS" in os.environ:
            step = float(os.environ["STEP_MS"]) / 1e3
            kept = best(chain, lambda k: k + 1, [k for k in range(17) if k * step <= t(k + 1)])
            flat_k = max(k for k in range(17) if k * step <= t(1))
            print(f"    drafter making a draft every {step * 1e3:.2f} ms: chains {kept[0]:.2f}x (k={kept[1]}); "
                  f"flat verify {chain(flat_k):.2f}x (k={flat_k})")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], [float(x) for x in sys.argv[2:]] or [0.5, 0.55, 0.6, 0.67, 0.9])
