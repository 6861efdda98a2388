"""The eighth session's A/B of the guard's lighter-load rule (docs/performance.md, "Eighth session").

One server (the bundled pair, through the SDK); the sweep's order (1, 2, 4, 8 streams, 2 requests per
stream, 128 tokens), pearl with the rule, pearl without it (the guard's `_lost_at_lighter_load`
answering False) and `off` interleaved, each pearl variant with its own guard learning from scratch.
Run from the repository root: `python docs/bench-session8/guard_lighter_load_ab.py PASSES`.
"""
import asyncio, sys, os, time, torch, json, statistics
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)
from duospec.bench.inprocess import BenchPair, encode_prompts
from duospec.bench.served import served_pipeline, sweep_point
from duospec.bench.prompts import load_prompts, DEFAULT_PROMPTS
from duospec.engine import load_tokenizer
pair = BenchPair("models/target", "models/draft")
prompts = encode_prompts(load_tokenizer(pair.target), load_prompts(DEFAULT_PROMPTS, 6), 256)
passes = int(sys.argv[1])
async def main():
    async with served_pipeline(pair, 4, 9, None) as served:
        c = served.coordinator
        real_use = type(c).use_speculation_choices
        c.use_speculation_choices = lambda variant: None
        await sweep_point(served, prompts, "pearl", 8, 1, 32, 4, lambda: None)
        await sweep_point(served, prompts, "off", 8, 1, 32, 4, lambda: None)
        res = {}
        for p in range(passes):
            for streams in (1, 2, 4, 8):
                for v in ("pearl-new", "pearl-old", "off"):
                    real_use(c, v)
                    for e in c.entries.values():
                        if v == "pearl-old":
                            e.scheduler.guard._lost_at_lighter_load = lambda b: False
                    r = await sweep_point(served, prompts, "off" if v == "off" else "pearl", streams, 2, 128, 4, lambda: None)
                    g = list(c.entries.values())[0].scheduler.guard.stats()
                    res.setdefault(f"{streams}/{v}", []).append(r["aggregate_tokens_per_s"])
                    print(p, streams, v, "%.1f" % r["aggregate_tokens_per_s"], "share %.2f" % g["speculating_share"], g["goodput"], flush=True)
        for streams in (1, 2, 4, 8):
            off = statistics.median(res[f"{streams}/off"])
            print(streams, {v: round(statistics.median(res[f"{streams}/{v}"]) / off, 3) for v in ("pearl-new", "pearl-old")},
                  "per pass new", [round(a / b, 2) for a, b in zip(res[f"{streams}/pearl-new"], res[f"{streams}/off"])],
                  "old", [round(a / b, 2) for a, b in zip(res[f"{streams}/pearl-old"], res[f"{streams}/off"])])
asyncio.run(main())
