"""8 streams x 2 requests: whole-pass tokens/s vs tokens/s while all 8 streams are live (until the first
stream finishes), for off, pearl (guard), pearl forced to speculate, pearl forced target-only."""
import asyncio, os, time, collections, statistics
import torch
torch.set_num_threads(1)
from duospec.bench.inprocess import BenchPair, encode_prompts
from duospec.bench.prompts import load_prompts, DEFAULT_PROMPTS
from duospec.bench.served import served_pipeline, run_client_mode
from duospec.bench.records import request_mode
from duospec.coordinator.guard import GuardState
from duospec.engine import load_tokenizer
pair = BenchPair("models/target", "models/draft", "cpu", "model", "auto")  # run from the repository root
prompts = encode_prompts(load_tokenizer(pair.target), load_prompts(DEFAULT_PROMPTS, 6), 512)
STREAMS, REQ = 8, 2
LABELS = ["off", "guard", "spec", "to"]
R = collections.defaultdict(list)
def setup(s, label):
    s.coordinator.use_speculation_choices(label)
    for e in s.coordinator.entries.values():
        g = e.scheduler.guard
        if label in ("spec", "to"):
            g.state = GuardState.SPECULATE if label == "spec" else GuardState.TARGET_ONLY
            g._close_window = lambda *a: None
async def one(client, prompt, mode, events):
    m, cache, tree = request_mode(mode)
    stream = await client.generate(prompt_token_ids=list(prompt.token_ids), max_new_tokens=128, mode=m,
                                   max_draft_tokens=4, ignore_eos=True, stream=True, speculation_cache=cache,
                                   speculation_tree=tree)
    async with stream:
        async for chunk in stream:
            if chunk.token_ids:
                events.append((time.perf_counter(), len(chunk.token_ids)))
async def sweep(s, label):
    setup(s, label)
    mode = "off" if label == "off" else "pearl"
    events, ends = [], []
    async def worker(i):
        for j in range(REQ):
            await one(s.client, prompts[(i * REQ + j) % len(prompts)], mode, events)
        ends.append(time.perf_counter())
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(STREAMS)))
    t1 = time.perf_counter()
    first = min(ends)
    full = sum(n for t, n in events if t <= first) / (first - t0)
    return sum(n for _, n in events) / (t1 - t0), full, (t1 - first) / (t1 - t0)
async def main():
    async with served_pipeline(pair, 4, 9, None) as s:
        for m in ("off", "pearl"):
            await run_client_mode(s, prompts[:1], m, 16, 4, lambda: None, variant=f"warmup-{m}")
        setup(s, "guard")
        await run_client_mode(s, prompts[:3], "pearl", 128, 4, lambda: None, variant="guard")
        for rep in range(int(os.environ.get("REP", 6))):
            for label in (LABELS if rep % 2 == 0 else LABELS[::-1]):
                R[label].append(await sweep(s, label))
            print(f"rep {rep}: " + " | ".join(f"{l} {R[l][-1][0]:.0f} full {R[l][-1][1]:.0f} tail {R[l][-1][2]:.2f}" for l in LABELS), flush=True)
        for l in LABELS:
            whole = [a[0] / b[0] for a, b in zip(R[l], R["off"])]
            full = [a[1] / b[1] for a, b in zip(R[l], R["off"])]
            print(f"{l}: whole/off median {statistics.median(whole):.3f} {[round(x, 2) for x in whole]}; "
                  f"all-8-live/off median {statistics.median(full):.3f} {[round(x, 2) for x in full]}; "
                  f"tail share median {statistics.median(x[2] for x in R[l]):.2f}")
asyncio.run(main())
