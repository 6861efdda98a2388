"""A/B: with CHANGE=branch, looked-up tokens as token-tree branches next to the drafter's chain (lookup) vs
not (nolookup; empty rounds keep their lookups in both); otherwise lookups on vs off altogether.
REPLAY=dir with target/ draft/ replay checkpoints (simulated) or MODELS=models (real). PATHS=inproc,server"""
import asyncio, os, statistics, dataclasses, time, collections
import torch
torch.set_num_threads(1)
from duospec.bench.inprocess import BenchPair, encode_prompts, open_local_coordinator, run_coordinator_mode
from duospec.bench.prompts import load_prompts, DEFAULT_PROMPTS
from duospec.bench.served import served_pipeline, run_client_mode
from duospec.engine import load_tokenizer
from duospec.coordinator.router import ModelRouter
root = os.environ.get("REPLAY") or os.environ.get("MODELS", "models")
pair = BenchPair(f"{root}/target", f"{root}/draft", "cpu")
prompts = encode_prompts(load_tokenizer(pair.target), load_prompts(DEFAULT_PROMPTS, 6), 512)
FLAG = {"on": True}
orig = ModelRouter.policy_for
def policy_for(self, entry, request):
    p = orig(self, entry, request)
    return dataclasses.replace(p, lookup=FLAG["on"] and p.lookup)
if os.environ.get("CHANGE") == "branch":
    from duospec.coordinator.sequence import Sequence
    orig_branches = Sequence.add_branches
    def add_branches(self, max_nodes, looked_up=()):
        return orig_branches(self, max_nodes, looked_up if FLAG["on"] else ())
    Sequence.add_branches = add_branches
else:
    ModelRouter.policy_for = policy_for
REP = int(os.environ.get("REP", 4))
R = collections.defaultdict(list)
def show(path):
    for label in ("lookup", "nolookup"):
        rs = R[(path, label)]; offs = R[(path, "off")]
        ratios = [a[0] / b[0] for a, b in zip(rs, offs)]
        print(f"{path} {label}: tok/s median {statistics.median(r[0] for r in rs):.1f}, x off median {statistics.median(ratios):.3f} {[round(x,2) for x in ratios]}, MAL {statistics.median(r[1] for r in rs):.2f}, lookup acc {rs[-1][2]}", flush=True)
    print(f"{path} off median {statistics.median(r[0] for r in R[(path,'off')]):.1f}", flush=True)
async def passes(path, runner):
    for label in ("lookup", "nolookup"):  # warm-up: each guard learns first
        FLAG["on"] = label == "lookup"
        await runner("pearl", label)
    await runner("off", "off")
    for rep in range(REP):
        order = ["lookup", "nolookup", "off"] if rep % 2 == 0 else ["off", "nolookup", "lookup"]
        for label in order:
            FLAG["on"] = label == "lookup"
            run = await runner("off" if label == "off" else "pearl", label)
            st = run.stats if hasattr(run, "stats") else None
            R[(path, label)].append((run.tokens_per_s, run.mean_accepted_length, None))
        print(path, rep, " ".join(f"{l} {R[(path,l)][-1][0]:.1f}/{R[(path,l)][-1][1] or 0:.2f}" for l in ("lookup","nolookup","off")), flush=True)
    show(path)
async def main():
    paths = os.environ.get("PATHS", "inproc,server").split(",")
    if "inproc" in paths:
        c = open_local_coordinator(pair, 4, 9)
        try:
            await passes("inproc", lambda mode, v: run_coordinator_mode(c, prompts, mode, 128, 4, "in-process", v, variant=v))
        finally:
            await c.close()
    if "server" in paths:
        async with served_pipeline(pair, 4, 9, None) as s:
            await passes("server", lambda mode, v: run_client_mode(s, prompts, mode, 128, 4, lambda: None, variant=v))
asyncio.run(main())
