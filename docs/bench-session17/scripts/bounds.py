"""Upper bounds of pearl over `off` on a simulation's own target cost curve (results.json of `duospec bench
--simulate`), for an i.i.d. drafter at acceptance a that always keeps up: chains of k drafts, E(a, k) t(1) / t(k+1);
trees that add every chain position's runner-up as a sibling (right with the recorded second-choice hit rate h
where the chain stops); and both on a flat curve (t(n) = t(1), k <= 8). With STEP_MS=s, also chains no longer
than the drafter makes during one verify (k s <= t(k + 1), s the pipeline's measured draft step), in steady state
(no restart after a rejection), on the curve and flat.

    [STEP_MS=1.5] python bounds.py RESULTS_JSON [a ...]
"""
import json, os, sys

import numpy as np

run = json.load(open(sys.argv[1]))["setup"]["simulation"]
t = lambda n: float(np.interp(n, run["target_cost"]["tokens"], run["target_cost"]["seconds"]))
h = run["second_choice_hit_rate"]
for a in [float(x) for x in sys.argv[2:]] or [0.5, 0.55, 0.6, 0.67, 0.9]:
    chain = lambda k: (1 - a ** (k + 1)) / (1 - a)
    tree = lambda k: chain(k) + h * sum(a ** i * (1 - a) for i in range(k))
    best = lambda tokens, rows, ks: max((tokens(k) * t(1) / t(rows(k)), k) for k in ks)
    c, tr = best(chain, lambda k: k + 1, range(17)), best(tree, lambda k: 2 * k + 1, range(17))
    print(f"a={a}: chains {c[0]:.2f}x (k={c[1]}), runner-up trees {tr[0]:.2f}x (k={tr[1]}); flat verify, k <= 8: "
          f"chains {chain(8):.2f}x, trees {max(tree(k) for k in range(9)):.2f}x  (h = {h:.2f})")
    if "STEP_MS" in os.environ:
        step = float(os.environ["STEP_MS"]) / 1e3
        kept = best(chain, lambda k: k + 1, [k for k in range(17) if k * step <= t(k + 1)])
        flat_k = max(k for k in range(17) if k * step <= t(1))
        print(f"    drafter making a draft every {step * 1e3:.2f} ms: chains {kept[0]:.2f}x (k={kept[1]}); flat verify "
              f"{chain(flat_k):.2f}x (k={flat_k})")
