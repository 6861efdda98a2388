"""A/B at N concurrent streams through the server: pearl's cap CAPS=4,8 vs off, pass by pass, each variant with
its own goodput guard. MODELS=models (real) or REPLAY=dir. STREAMS=8 REP=4"""
import asyncio, os, statistics, collections, time
import torch
torch.set_num_threads(1)
from duospec.bench.inprocess import BenchPair, encode_prompts
from duospec.bench.prompts import load_prompts, DEFAULT_PROMPTS
from duospec.bench.served import served_pipeline, client_request
from duospec.engine import load_tokenizer
from duospec.coordinator.api import SpeculationMode
from duospec.coordinator.config import SpeculationDefaults
root = os.environ.get("REPLAY") or os.environ.get("MODELS", "models")
pair = BenchPair(f"{root}/target", f"{root}/draft", "cpu")
prompts = encode_prompts(load_tokenizer(pair.target), load_prompts(DEFAULT_PROMPTS, 6), 512)
CAPS = [int(c) for c in os.environ.get("CAPS", "4,8").split(",")]
STREAMS, REP = int(os.environ.get("STREAMS", 8)), int(os.environ.get("REP", 4))
labels = [f"cap{c}" for c in CAPS] + ["off"]
CAP = {"v": None}
async def point(s, label):
    s.coordinator.use_speculation_choices(label)
    CAP["v"] = None if label == "off" else int(label[3:])
    mode = "off" if label == "off" else "pearl"
    async def worker(i):
        return [await client_request(s.client, prompts[(i * 2 + j) % len(prompts)], mode, 128, s.model) for j in range(2)]
    t0 = time.perf_counter()
    recs = [r for rs in await asyncio.gather(*(worker(i) for i in range(STREAMS))) for r in rs]
    return sum(len(r.token_ids) for r in recs) / (time.perf_counter() - t0)
async def main():
    async with served_pipeline(pair, SpeculationDefaults(mode=SpeculationMode.PEARL), None) as s:
        gen = s.client.generate
        async def generate(*a, **k):
            if CAP["v"] is not None:
                k["max_draft_tokens"] = CAP["v"]
            return await gen(*a, **k)
        s.client.generate = generate
        for label in labels:  # warm-up: each guard learns first
            await point(s, label)
        R = collections.defaultdict(list)
        for rep in range(REP):
            for label in (labels if rep % 2 == 0 else labels[::-1]):
                R[label].append(await point(s, label))
            print(rep, " ".join(f"{l} {R[l][-1]:.1f}" for l in labels), flush=True)
        for label in labels[:-1]:
            ratios = [a / b for a, b in zip(R[label], R["off"])]
            print(f"{STREAMS} streams {label}: x off median {statistics.median(ratios):.3f} {[round(x, 2) for x in ratios]}", flush=True)
asyncio.run(main())
