import asyncio, os, sys, time, dataclasses, statistics
import torch; torch.set_num_threads(1)
from duospec.bench.inprocess import BenchPair, encode_prompts, open_local_coordinator, run_coordinator_mode
from duospec.bench.prompts import load_prompts, DEFAULT_PROMPTS
from duospec.engine import load_tokenizer
from duospec.coordinator.config import SpeculationDefaults
from duospec.target_worker.verifier import Verifier
root = os.environ["REPLAY"]
pair = BenchPair(f"{root}/target", f"{root}/draft", "cpu")
prompts = encode_prompts(load_tokenizer(pair.target), load_prompts(DEFAULT_PROMPTS, 6), 512)
LOG = []
orig = Verifier.run
def run(self, batch):
    t0 = time.perf_counter(); out = orig(self, batch); t1 = time.perf_counter()
    q = any(i.if_continues for i in batch.items)
    LOG.append((t0, t1, q, len(out.skipped_seq_ids), sum(len(i.draft_tokens) for i in batch.items), [v.n_accepted for v in out.verdicts]))
    return out
Verifier.run = run
async def main():
    for q in (True, False):
        c = open_local_coordinator(pair, dataclasses.replace(SpeculationDefaults(), queue_next_round=q))
        await run_coordinator_mode(c, prompts, "pearl", 128, "in-process", "p", variant="pearl")
        LOG.clear()
        r = await run_coordinator_mode(c, prompts, "pearl", 128, "in-process", "q", variant="pearl")
        await c.close()
        gaps = {"after_normal": [], "queued_ran": [], "queued_skipped": [], "normal_after_skip": []}
        ks = {"queued_ran": [], "normal": []}
        for prev, cur in zip(LOG, LOG[1:]):
            gap = (cur[0] - prev[1]) * 1e3
            if cur[2] and cur[3] == 0: gaps["queued_ran"].append(gap); ks["queued_ran"].append(cur[4])
            elif cur[2]: gaps["queued_skipped"].append(gap)
            elif prev[2] and prev[3]: gaps["normal_after_skip"].append(gap)
            else: gaps["after_normal"].append(gap); ks["normal"].append(cur[4])
        print(q, round(r.tokens_per_s, 1), {k: (len(v), round(statistics.median(v), 2) if v else None) for k, v in gaps.items()},
              {k: round(statistics.mean(v), 2) if v else None for k, v in ks.items()}, flush=True)
asyncio.run(main())
