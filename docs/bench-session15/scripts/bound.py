"""Upper bound of pearl over off on a simulation's measured cost curve: the target never idle, every round
a full chunk of k drafts from an i.i.d. drafter at acceptance a, the drafter keeping up (k steps within the
verify), no lookups. max_k E(a,k) * t(1) / t(k+1)."""
import json, sys, numpy as np
r = json.load(open(sys.argv[1])); s = r['setup']['simulation']
tt, ts = s['target_cost']['tokens'], s['target_cost']['seconds']
dt, ds = s['draft_cost']['tokens'], s['draft_cost']['seconds']
t = lambda n: float(np.interp(n, tt, ts)); d1 = ds[0]
for a in [float(x) for x in sys.argv[2:]]:
    best = []
    for k in range(1, 17):
        E = (1 - a ** (k + 1)) / (1 - a)
        keeps_up = k * d1 <= t(k + 1)
        best.append((E * t(1) / t(k + 1), k, keeps_up))
    ok = [b for b in best if b[2]]
    print(f"alpha {a}: t(1) {t(1)*1e3:.2f} ms, draft step {d1*1e3:.2f} ms; bound {max(ok)[0]:.2f}x off at k={max(ok)[1]} (drafter keeping up); vanilla g=4: {((1-a**5)/(1-a))*t(1)/(t(5)+4*d1):.2f}x")
