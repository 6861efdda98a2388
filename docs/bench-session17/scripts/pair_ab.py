"""Two replay pairs side by side in one process (an in-process coordinator each), alternating passes of pearl and
`off` on each; every pass's pearl over the `off` of the same pair.

    A=DIR_A B=DIR_B REP=4 python pair_ab.py

model_vs_eagle.txt: A = session 16's `sim` replay (the draft model), B = this session's `eagle-sim` replay with its
target cost replaced by A's (the same target model; the two were measured at different moments of the VM)."""
import asyncio, os, statistics
import torch; torch.set_num_threads(1)
from duospec.bench.inprocess import BenchPair, encode_prompts, open_local_coordinator, run_coordinator_mode
from duospec.bench.prompts import load_prompts, DEFAULT_PROMPTS
from duospec.engine import load_tokenizer
from duospec.coordinator.config import SpeculationDefaults


async def main():
    roots = {"A": os.environ["A"], "B": os.environ["B"]}
    REP = int(os.environ.get("REP", 4))
    coords, prompts = {}, None
    for label, root in roots.items():
        p = BenchPair(f"{root}/target", f"{root}/draft", "cpu")
        prompts = prompts or encode_prompts(load_tokenizer(p.target), load_prompts(DEFAULT_PROMPTS, 6), 512)
        coords[label] = open_local_coordinator(p, SpeculationDefaults())
    R = {k: [] for k in ("A pearl", "A off", "B pearl", "B off")}
    for label in ("A", "B"):
        for mode in ("pearl", "off"):
            await run_coordinator_mode(coords[label], prompts, mode, 128, "in-process", f"w{label}{mode}", variant=mode)
    for rep in range(REP):
        order = [("A", "pearl"), ("A", "off"), ("B", "pearl"), ("B", "off")]
        for label, mode in (order if rep % 2 == 0 else order[::-1]):
            run = await run_coordinator_mode(coords[label], prompts, mode, 128, "in-process", f"{label}{mode}{rep}", variant=mode)
            R[f"{label} {mode}"].append(run.tokens_per_s)
        print(rep, {k: round(v[-1], 1) for k, v in R.items()}, flush=True)
    for label in ("A", "B"):
        ratios = [p / o for p, o in zip(R[f"{label} pearl"], R[f"{label} off"])]
        print(f"{label} ({roots[label]}): pearl {statistics.median(R[f'{label} pearl']):.1f} tok/s, off {statistics.median(R[f'{label} off']):.1f}, "
              f"pearl x off {statistics.median(ratios):.3f} {[round(r, 2) for r in ratios]}", flush=True)
    for c in coords.values():
        await c.close()
asyncio.run(main())
