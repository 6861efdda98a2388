"""pearl / off on two replay checkpoints, alternating pass by pass in one process (in-process path).

    python docs/bench-session16/scripts/replay_pair_ab.py DIR_A DIR_B        (each a replay-devices/)
    python docs/bench-session16/scripts/replay_pair_ab.py --faster-draft SRC DST 0.00025
        copies the replay checkpoint SRC to DST with every point of the draft's cost curve lowered by
        the given seconds (floor 0.1 ms): what a faster drafter step would be worth.
"""
import asyncio, json, shutil, statistics, sys
import torch
torch.set_num_threads(1)
from duospec.bench.inprocess import BenchPair, encode_prompts, open_local_coordinator, run_coordinator_mode
from duospec.bench.prompts import load_prompts, DEFAULT_PROMPTS
from duospec.coordinator.config import SpeculationDefaults
from duospec.engine import load_tokenizer


def faster_draft(src: str, dst: str, seconds: float) -> None:
    shutil.copytree(src, dst)
    path = f"{dst}/draft/replay.json"
    table = json.load(open(path))
    table["cost"]["seconds"] = [max(0.0001, s - seconds) for s in table["cost"]["seconds"]]
    json.dump(table, open(path, "w"))


async def main(dirs):
    coordinators = []
    for d in dirs:
        pair = BenchPair(f"{d}/target", f"{d}/draft", "cpu")
        prompts = encode_prompts(load_tokenizer(pair.target), load_prompts(DEFAULT_PROMPTS, 6), 512)
        coordinators.append((d, open_local_coordinator(pair, SpeculationDefaults()), prompts))
    ratios = {d: [] for d in dirs}
    for rep in range(4):  # the first pass warms each coordinator's guard up
        for d, c, prompts in (coordinators if rep % 2 == 0 else coordinators[::-1]):
            off = await run_coordinator_mode(c, prompts, "off", 128, "in-process", f"o{rep}", variant="off")
            pearl = await run_coordinator_mode(c, prompts, "pearl", 128, "in-process", f"p{rep}", variant="pearl")
            if rep:
                ratios[d].append(pearl.tokens_per_s / off.tokens_per_s)
            print(d, rep, round(pearl.tokens_per_s, 1), round(off.tokens_per_s, 1), flush=True)
    for d, c, _ in coordinators:
        print(d, "pearl x off median", round(statistics.median(ratios[d]), 3), [round(x, 2) for x in ratios[d]])
        await c.close()


if sys.argv[1] == "--faster-draft":
    faster_draft(sys.argv[2], sys.argv[3], float(sys.argv[4]))
else:
    asyncio.run(main(sys.argv[1:]))
