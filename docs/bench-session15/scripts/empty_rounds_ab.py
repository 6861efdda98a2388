"""A/B: empty rounds after a rejection allowed (sized: the default) vs never (fixed: wait for the restarted drafter), vs off."""
import asyncio, os, statistics, collections
import torch
torch.set_num_threads(1)
from duospec.bench.inprocess import BenchPair, encode_prompts, open_local_coordinator, run_coordinator_mode
from duospec.bench.prompts import load_prompts, DEFAULT_PROMPTS
from duospec.bench.served import served_pipeline, run_client_mode
from duospec.engine import load_tokenizer
from duospec.coordinator.config import SpeculationDefaults
root = os.environ.get("REPLAY") or os.environ.get("MODELS", "models")
pair = BenchPair(f"{root}/target", f"{root}/draft", "cpu")
prompts = encode_prompts(load_tokenizer(pair.target), load_prompts(DEFAULT_PROMPTS, 6), 512)
FLAG = {"sized": True}  # "sized" = the default: empty rounds allowed; "fixed" = none (wait for a draft)
from duospec.coordinator.scheduler import Scheduler
allowed = Scheduler._may_verify_without_drafts
Scheduler._may_verify_without_drafts = lambda self, seq: allowed(self, seq) if FLAG["sized"] else False
REP = int(os.environ.get("REP", 3))
R = collections.defaultdict(list)
labels = ["sized", "fixed", "off"]
async def passes(path, runner):
    for label in labels[:2]:
        FLAG["sized"] = label == "sized"
        await runner("pearl", label)
    await runner("off", "off")
    for rep in range(REP):
        for label in (labels if rep % 2 == 0 else labels[::-1]):
            FLAG["sized"] = label == "sized"
            run = await runner("off" if label == "off" else "pearl", label)
            R[(path, label)].append((run.tokens_per_s, run.mean_accepted_length))
        print(path, rep, " ".join(f"{l} {R[(path,l)][-1][0]:.1f}/{R[(path,l)][-1][1] or 0:.2f}" for l in labels), flush=True)
    offs = R[(path, "off")]
    for label in labels[:2]:
        rs = R[(path, label)]
        ratios = [a[0] / b[0] for a, b in zip(rs, offs)]
        print(f"{path} {label}: tok/s {statistics.median(r[0] for r in rs):.1f}, x off {statistics.median(ratios):.3f} {[round(x,2) for x in ratios]}, MAL {statistics.median(r[1] for r in rs):.2f}", flush=True)
    print(f"{path} off {statistics.median(r[0] for r in offs):.1f}", flush=True)
async def main():
    paths = os.environ.get("PATHS", "inproc,server").split(",")
    if "inproc" in paths:
        c = open_local_coordinator(pair, SpeculationDefaults())
        try:
            await passes("inproc", lambda mode, v: run_coordinator_mode(c, prompts, mode, 128, "in-process", v, variant=v))
        finally:
            await c.close()
    if "server" in paths:
        async with served_pipeline(pair, SpeculationDefaults(), None) as s:
            await passes("server", lambda mode, v: run_client_mode(s, prompts, mode, 128, lambda: None, variant=v))
asyncio.run(main())
