"""What pearl's verify rounds look like, in-process: their kinds and what follows what, the chunk sizes,
the empty rounds' lookups, and the drafter's steps (tokens kept vs drafted, time in a step beside its forward).

    REPLAY=<a `duospec bench --simulate` run>/replay-devices python docs/bench-session16/scripts/rounds.py
    MODELS=models python docs/bench-session16/scripts/rounds.py      (the real pair)

Round kinds: E an empty round (no draft; it verifies looked-up tokens), F the chain accepted whole, R a
rejection on the chain, B the path went into a token-tree branch. One warm-up run, then one measured run of
the 6 standard prompts x 128 tokens. Reads internals by wrapping methods: a diagnostic, not a benchmark.
"""
import asyncio, collections, os, statistics, time
import torch
torch.set_num_threads(1)
from duospec.bench.inprocess import BenchPair, encode_prompts, open_local_coordinator, run_coordinator_mode
from duospec.bench.prompts import load_prompts, DEFAULT_PROMPTS
from duospec.engine import load_tokenizer
from duospec.coordinator.config import SpeculationDefaults
from duospec.coordinator.sequence import Sequence
from duospec.draft_worker.drafter import Drafter

root = os.environ.get("REPLAY") or os.environ.get("MODELS", "models")
pair = BenchPair(f"{root}/target", f"{root}/draft", "cpu")
prompts = encode_prompts(load_tokenizer(pair.target), load_prompts(DEFAULT_PROMPTS, 6), 512)
C, TRANS, CHUNKS, LAST, T = collections.Counter(), collections.Counter(), collections.Counter(), {}, collections.Counter()

apply_verdict = Sequence.apply_verdict


def counted_verdict(self, n_accepted, next_token, recovered, path=()):
    k = len(self.verify_tokens or ())
    branch = self._tree_outcome(path)[1] if path else None
    if self.empty_round or not k:
        kind = "E"
        C["empty"] += 1
        C["empty looked up"] += len(self.lookup_tokens or ())
        C["empty accepted"] += min(n_accepted, len(self.lookup_tokens or ()))
        C["empty: drafts there at its verdict"] += len(self.drafts)
    else:
        kind = "B" if branch is not None else "R" if recovered else "F"
        C["drafted"] += 1
        C["chain drafts"] += k
        C["branch nodes"] += len(self.branch_tokens)
        CHUNKS[k] += 1
    C[kind] += 1
    previous, LAST[self.seq_id] = LAST.get(self.seq_id), kind
    if previous:
        TRANS[previous + kind] += 1
    return apply_verdict(self, n_accepted, next_token, recovered, path)


Sequence.apply_verdict = counted_verdict
step = Drafter.step


def timed_step(self):
    forward = self.proposer.runner.forward_last if hasattr(self.proposer, "runner") else None
    spent = [0.0]
    if forward is not None:
        def timed_forward(*a, **k):
            started = time.perf_counter()
            try:
                return forward(*a, **k)
            finally:
                spent[0] += time.perf_counter() - started
        self.proposer.runner.forward_last = timed_forward
    started = time.perf_counter()
    try:
        chunks = step(self)
    finally:
        if forward is not None:
            del self.proposer.runner.forward_last
    T["steps"] += 1
    T["step s"] += time.perf_counter() - started
    T["forward s"] += spent[0]
    for chunk in chunks:
        T["hedge tokens" if chunk.HasField("hedge") else "main-line tokens"] += len(chunk.tokens)
    return chunks


Drafter.step = timed_step


async def main():
    coordinator = open_local_coordinator(pair, SpeculationDefaults())
    try:
        await run_coordinator_mode(coordinator, prompts, "pearl", 128, "in-process", "warm", variant="pearl")
        for counter in (C, TRANS, CHUNKS, T):
            counter.clear()
        LAST.clear()
        run = await run_coordinator_mode(coordinator, prompts, "pearl", 128, "in-process", "run", variant="pearl")
        stats = await coordinator.stats()
    finally:
        await coordinator.close()
    model = next(iter(stats["models"].values()))
    print(f"pearl {run.tokens_per_s:.1f} tokens/s, {sum(len(r.token_ids) for r in run.records)} tokens")
    print("rounds:", {k: C[k] for k in ("E", "F", "R", "B")}, f"mean chain {C['chain drafts'] / max(1, C['drafted']):.2f} drafts,"
          f" {C['branch nodes'] / max(1, C['drafted']):.2f} branch nodes")
    print("chain sizes:", sorted(CHUNKS.items()))
    print("what follows what:", sorted(TRANS.items()))
    print(f"empty rounds: {C['empty looked up'] / max(1, C['empty']):.2f} looked up, {C['empty accepted'] / max(1, C['empty']):.2f}"
          f" accepted, {C['empty: drafts there at its verdict'] / max(1, C['empty']):.2f} drafts there at the verdict")
    print(f"drafter: {T['steps']} steps, {T['main-line tokens']} main-line and {T['hedge tokens']} hedge tokens drafted;"
          f" {T['step s'] / max(1, T['steps']) * 1e3:.3f} ms a step, of it {T['forward s'] / max(1, T['steps']) * 1e3:.3f} ms forward")
    patience = model["patience"]
    print(f"coordinator's measures (both runs): draft step {patience['draft_step_s'] * 1e3:.2f} ms, first draft after a"
          f" restart {patience['first_draft_s'] * 1e3:.2f} ms, round overhead {patience['round_overhead_s'] * 1e3:.2f} ms")

asyncio.run(main())
