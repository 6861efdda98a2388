"""Server, real pair: pearl with lookup / without / off, alternating, STREAMS streams x REQ requests x 128 tokens."""
import asyncio, os, statistics, dataclasses, time, collections
import torch
torch.set_num_threads(1)
from duospec.bench.inprocess import BenchPair, encode_prompts
from duospec.bench.prompts import load_prompts, DEFAULT_PROMPTS
from duospec.bench.served import served_pipeline, run_client_mode, client_request
from duospec.engine import load_tokenizer
from duospec.coordinator.router import ModelRouter
pair = BenchPair("models/target", "models/draft", "cpu")
prompts = encode_prompts(load_tokenizer(pair.target), load_prompts(DEFAULT_PROMPTS, 6), 512)
FLAG = {"on": True}
orig = ModelRouter.policy_for
def policy_for(self, entry, request):
    p = orig(self, entry, request)
    return dataclasses.replace(p, lookup=FLAG["on"] and p.lookup)
ModelRouter.policy_for = policy_for
STREAMS = [int(x) for x in os.environ.get("STREAMS", "1,8").split(",")]; REQ = int(os.environ.get("REQ", 2))
LABELS = ["lookup", "nolookup", "off"]
R = collections.defaultdict(list)
async def sweep(s, label, streams):
    FLAG["on"] = label == "lookup"
    s.coordinator.use_speculation_choices(label)
    mode = "off" if label == "off" else "pearl"
    async def worker(i):
        n = 0
        for j in range(REQ):
            r = await client_request(s.client, prompts[(i * REQ + j) % len(prompts)], mode, 128, 4)
            n += len(r.token_ids)
        return n
    t = time.perf_counter()
    n = sum(await asyncio.gather(*(worker(i) for i in range(streams))))
    return n / (time.perf_counter() - t)
async def main():
    async with served_pipeline(pair, 4, 9, None) as s:
        for label in LABELS:  # warm-up: each guard learns 1 stream first, as in the bench
            FLAG["on"] = label == "lookup"
            await run_client_mode(s, prompts[:3], "off" if label == "off" else "pearl", 128, 4, lambda: None, variant=label)
        for rep in range(int(os.environ.get("REP", 4))):
            for streams in STREAMS:
                for label in (LABELS if rep % 2 == 0 else LABELS[::-1]):
                    R[(label, streams)].append(await sweep(s, label, streams))
                print(f"rep {rep} streams {streams}: " + " ".join(f"{l} {R[(l, streams)][-1]:.1f}" for l in LABELS), flush=True)
        for streams in STREAMS:
            for label in ("lookup", "nolookup"):
                ratios = [a / b for a, b in zip(R[(label, streams)], R[("off", streams)])]
                print(f"{streams} streams {label}: median {statistics.median(R[(label, streams)]):.1f} tok/s, x off median {statistics.median(ratios):.3f} {[round(x, 2) for x in ratios]}")
            print(f"{streams} streams off median {statistics.median(R[('off', streams)]):.1f}")
asyncio.run(main())
