"""A/B of a guard change against the behaviour before it, `off` alongside, alternating pass by pass.

CHANGE=prefill (with guard-prefill-rounds.patch applied): prefill rounds counted net of their prompt
time (new) vs not measured (old). CHANGE=noise (with guard-noise-margin.patch applied): the margin
plus the windows' measured scatter (new) vs the fixed margin (old). STREAMS=8,1 REP=12.
"""
import asyncio, os, time, collections, statistics
import torch
torch.set_num_threads(1)
from duospec.bench.inprocess import BenchPair, encode_prompts
from duospec.bench.prompts import load_prompts, DEFAULT_PROMPTS
from duospec.bench.served import served_pipeline, run_client_mode, client_request
from duospec.engine import load_tokenizer
pair = BenchPair("models/target", "models/draft", "cpu", "model", "auto")  # run from the repository root
prompts = encode_prompts(load_tokenizer(pair.target), load_prompts(DEFAULT_PROMPTS, 6), 512)
STREAMS = [int(x) for x in os.environ.get("STREAMS", "8").split(",")]; REQ = int(os.environ.get("REQ", 2))
LABELS = ["new", "old", "off"]
CHANGE = os.environ["CHANGE"]
R = collections.defaultdict(list)
SH = collections.defaultdict(list)
def setup(s, label):
    s.coordinator.use_speculation_choices(label)
    for e in s.coordinator.entries.values():
        sch = e.scheduler
        if label == "old" and CHANGE == "prefill":
            sch._prompt_seconds = lambda inflight, fs: 0.0 if inflight.decode_only else None
        elif label == "old" and CHANGE == "noise":
            sch.guard._margin = lambda bucket, g=sch.guard: g.margin
async def sweep(s, label, streams):
    mode = "off" if label == "off" else "pearl"
    setup(s, label)
    g = list(s.coordinator.entries.values())[0].scheduler.guard
    r0 = dict(g.rounds)
    async def worker(i):
        n = 0
        for j in range(REQ):
            r = await client_request(s.client, prompts[(i * REQ + j) % len(prompts)], mode, 128, 4)
            n += len(r.token_ids)
        return n
    t = time.perf_counter()
    n = sum(await asyncio.gather(*(worker(i) for i in range(streams))))
    rate = n / (time.perf_counter() - t)
    if label != "off":
        d = {k: g.rounds[k] - r0[k] for k in g.rounds}
        tot = sum(d.values())
        SH[(label, streams)].append(round(d[list(d)[0]] / tot, 2) if tot else None)
    return rate
async def main():
    async with served_pipeline(pair, 4, 9, None) as s:
        for m in ("off", "pearl"):
            await run_client_mode(s, prompts[:1], m, 16, 4, lambda: None, variant=f"warmup-{m}")
        for label in ("new", "old"):  # each guard learns 1 stream first, as in the bench
            setup(s, label)
            await run_client_mode(s, prompts[:3], "pearl", 128, 4, lambda: None, variant=label)
        for rep in range(int(os.environ.get("REP", 6))):
            for streams in STREAMS:
                for label in (LABELS if rep % 2 == 0 else LABELS[::-1]):
                    R[(label, streams)].append(await sweep(s, label, streams))
                print(f"rep {rep} streams {streams}: " + " ".join(f"{l} {R[(l, streams)][-1]:.1f}" for l in LABELS), flush=True)
        for streams in STREAMS:
            for label in ("new", "old"):
                ratios = [a / b for a, b in zip(R[(label, streams)], R[("off", streams)])]
                print(f"{streams} streams {label}: median {statistics.median(R[(label, streams)]):.1f}, median ratio {statistics.median(ratios):.3f} {[round(x, 2) for x in ratios]} spec share {SH[(label, streams)]}")
            print(f"{streams} streams off median {statistics.median(R[('off', streams)]):.1f}")
asyncio.run(main())
