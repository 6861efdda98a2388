"""The draft length the adaptive length's fitted line picks against the one the measured curve says, in one-round
arithmetic (E(a, k) / t(k + 1)), on a simulation's target cost curve: the line fitted (as the scheduler does) to
forwards of 2-10 tokens drawn uniformly from the curve.

    python line_vs_curve.py RESULTS_JSON
"""
import json, random, sys

import numpy as np

from duospec.coordinator.adaptive import VerifyCostModel, best_draft_length, expected_tokens

cost = json.load(open(sys.argv[1]))["setup"]["simulation"]["target_cost"]
t = lambda n: float(np.interp(n, cost["tokens"], cost["seconds"]))
line, rng = VerifyCostModel(), random.Random(0)
for _ in range(200):
    n = rng.randint(2, 10)
    line.observe(n, t(n))
print("line: fixed %.2f ms + %.3f ms a token" % tuple(x * 1e3 for x in line.coefficients()))
for a in (0.5, 0.55, 0.6, 0.67, 0.75, 0.9):
    rate = {k: expected_tokens(a, k) / t(k + 1) for k in range(9)}
    best, by_line = max(rate, key=rate.get), best_draft_length([a], line, 8)
    print(f"a={a}: the line picks k={by_line}, the curve k={best}: {100 * (1 - rate[by_line] / rate[best]):.1f} % fewer tokens per verify second")
