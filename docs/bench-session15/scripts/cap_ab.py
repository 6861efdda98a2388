"""A/B: pearl's draft cap CAPS=4,8,12 (the request's max_draft_tokens) vs off, alternating pass by pass, same
replay checkpoints. REPLAY=dir (simulated: a `duospec bench --simulate` run's replay-devices/) or MODELS=models
(real). PATHS=inproc,server REP=3"""
import asyncio, os, statistics, collections
import torch
torch.set_num_threads(1)
from duospec.bench.inprocess import BenchPair, encode_prompts, open_local_coordinator, run_coordinator_mode
from duospec.bench.prompts import load_prompts, DEFAULT_PROMPTS
from duospec.bench.served import served_pipeline, run_client_mode
from duospec.engine import load_tokenizer
root = os.environ.get("REPLAY") or os.environ.get("MODELS", "models")
pair = BenchPair(f"{root}/target", f"{root}/draft", "cpu")
prompts = encode_prompts(load_tokenizer(pair.target), load_prompts(DEFAULT_PROMPTS, 6), 512)
CAPS = [int(c) for c in os.environ.get("CAPS", "4,8,12").split(",")]
REP = int(os.environ.get("REP", 3))
R = collections.defaultdict(list)
import dataclasses, duospec.bench.inprocess as bi
from duospec.coordinator.config import SpeculationDefaults
from duospec.coordinator.api import SpeculationMode
CAP = {"v": None}
_orig_rf = bi.request_for
def request_for(*a, **k):
    r = _orig_rf(*a, **k)
    return dataclasses.replace(r, max_draft_tokens=CAP["v"])
bi.request_for = request_for
SPEC = SpeculationDefaults(mode=SpeculationMode.PEARL, max_draft_tokens=4, gamma=4, max_lookahead=9)
labels = [f"cap{c}" for c in CAPS] + ["off"]
async def passes(path, runner):
    for c in CAPS:
        CAP["v"] = c
        await runner("pearl", c, f"cap{c}")
    await runner("off", 4, "off")
    for rep in range(REP):
        order = labels if rep % 2 == 0 else labels[::-1]
        for label in order:
            c = 4 if label == "off" else int(label[3:])
            CAP["v"] = None if label == "off" else c
            run = await runner("off" if label == "off" else "pearl", c, label)
            R[(path, label)].append((run.tokens_per_s, run.mean_accepted_length))
        print(path, rep, " ".join(f"{l} {R[(path,l)][-1][0]:.1f}/{R[(path,l)][-1][1] or 0:.2f}" for l in labels), flush=True)
    offs = R[(path, "off")]
    for label in labels[:-1]:
        rs = R[(path, label)]
        ratios = [a[0] / b[0] for a, b in zip(rs, offs)]
        print(f"{path} {label}: tok/s {statistics.median(r[0] for r in rs):.1f}, x off {statistics.median(ratios):.3f} {[round(x,2) for x in ratios]}, MAL {statistics.median(r[1] for r in rs):.2f}", flush=True)
    print(f"{path} off {statistics.median(r[0] for r in offs):.1f}", flush=True)
async def main():
    paths = os.environ.get("PATHS", "inproc,server").split(",")
    if "inproc" in paths:
        c = open_local_coordinator(pair, SPEC)
        try:
            await passes("inproc", lambda mode, g, v: run_coordinator_mode(c, prompts, mode, 128, "in-process", v, variant=v))
        finally:
            await c.close()
    if "server" in paths:
        async with served_pipeline(pair, SPEC, None) as s:
            _gen = s.client.generate
            async def generate(*a, **k):
                if CAP["v"] is not None:
                    k["max_draft_tokens"] = CAP["v"]
                return await _gen(*a, **k)
            s.client.generate = generate
            await passes("server", lambda mode, g, v: run_client_mode(s, prompts, mode, 128, lambda: None, variant=v))
asyncio.run(main())
