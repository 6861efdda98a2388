"""Copies a `duospec bench --simulate` replay checkpoint pair with the target's verify cost flattened: every
point up to FLAT tokens costs what one token does (a GPU-like, memory-bound verify), the rest as measured.

    python flatten_target_cost.py SRC/replay-devices DST [FLAT=16]
"""
import json, shutil, sys

src, dst = sys.argv[1], sys.argv[2]
flat = int(sys.argv[3]) if len(sys.argv) > 3 else 16
shutil.copytree(src, dst)
path = f"{dst}/target/replay.json"
table = json.load(open(path))
cost = table["cost"]
one = cost["seconds"][0]
cost["seconds"] = [one if n <= flat else s for n, s in zip(cost["tokens"], cost["seconds"])]
cost["source"] += f"; flattened to t(1) up to {flat} tokens (a GPU-like verify curve)"
json.dump(table, open(path, "w"))
print(dst, [round(s * 1e3, 2) for s in cost["seconds"]])
