"""Side-by-side A/B of one scheduling choice against `off`, pass by pass on the same coordinator (in-process) and
server, each variant with its own goodput guard. The logs in docs/bench-session15/ came from it (as per-variant
copies of this script; their label "sized" is A, "fixed" B).

    VARIANT=cap CAPS=4,8,12   pearl's most drafts per verify (the request's max_draft_tokens)
    VARIANT=tree              A: trees sized by their rows' cost, B: the configured tree_nodes (needs
                              tree-sizing-measured.patch applied)
    VARIANT=lookahead         A: the drafter's lookahead follows the adaptive length, B: the cap's (needs
                              lookahead-follows-length.patch applied)
    VARIANT=empty             A: empty rounds after a rejection (the code as it is), B: wait for the drafter
    VARIANT=hedgeless         A: the code as it is, B: no hedges drafted (the tree keeps the runner-up siblings)
    VARIANT=queue             A: the next round queued at the target before its verdict, B: not (needs
                              bench-session17/scripts/queued-round.patch applied)
    VARIANT=costline          A: the verify cost measured per batch size (needs
                              bench-session17/scripts/cost-table.patch applied), B: the fitted line, as the code is
    VARIANT=notree            A: the code as it is, B: no token trees (chains only; the cache stays)
    VARIANT=extend            A: each greedy model draft extended by up to EXT=4 tokens that followed it earlier in
                              the text (a MIN_N=3-gram match; drafter-side: PATHS=inproc only), B: the code as it is
    VARIANT=wide              A: the code as it is, B: a hedge for every position's runner-up (N=8), DEPTH=2
                              tokens deep, from the first step (drafter-side: PATHS=inproc only)

REPLAY=dir (a `duospec bench --simulate` run's replay-devices/) or MODELS=models (real). PATHS=inproc,server REP=3;
STREAMS=8: through the server only, 8 concurrent streams of 2 requests each per pass (aggregate tokens/s).
"""
import asyncio, collections, dataclasses, os, statistics, time
import torch
torch.set_num_threads(1)
import duospec.bench.inprocess as bench_inprocess
from duospec.bench.inprocess import BenchPair, encode_prompts, open_local_coordinator, run_coordinator_mode
from duospec.bench.prompts import load_prompts, DEFAULT_PROMPTS
from duospec.bench.served import client_request, served_pipeline, run_client_mode
from duospec.engine import load_tokenizer
from duospec.coordinator.config import SpeculationDefaults

root = os.environ.get("REPLAY") or os.environ.get("MODELS", "models")
pair = BenchPair(f"{root}/target", f"{root}/draft", "cpu")
prompts = encode_prompts(load_tokenizer(pair.target), load_prompts(DEFAULT_PROMPTS, 6), 512)
VARIANT, REP, STREAMS = os.environ["VARIANT"], int(os.environ.get("REP", 3)), int(os.environ.get("STREAMS", 1))
NOW = {"label": "A", "cap": None}  # the variant running now

if VARIANT == "cap":
    LABELS = [f"cap{c}" for c in os.environ.get("CAPS", "4,8,12").split(",")]
    request_for = bench_inprocess.request_for
    bench_inprocess.request_for = lambda *a, **k: dataclasses.replace(request_for(*a, **k), max_draft_tokens=NOW["cap"])
else:
    LABELS = ["A", "B"]
    if VARIANT == "tree":
        from duospec.coordinator.verify_items import VerifyItems
        sized = VerifyItems._tree_size
        VerifyItems._tree_size = lambda self, seq, n: sized(self, seq, n) if NOW["label"] == "A" else seq.policy.tree_nodes
    elif VARIANT == "lookahead":
        from duospec.coordinator.sequence import Sequence
        follow = Sequence.draft_until
        Sequence.draft_until = lambda self, k=None: follow(self, k if NOW["label"] == "A" else None)
    elif VARIANT == "empty":
        from duospec.coordinator.scheduler import Scheduler
        allowed = Scheduler._may_verify_without_drafts
        Scheduler._may_verify_without_drafts = lambda self, seq: allowed(self, seq) if NOW["label"] == "A" else False
    elif VARIANT == "wide":  # B: hedge every position's runner-up from the first step, shallow
        from duospec.draft_worker.drafter import Drafter
        from duospec.coordinator.draft_commands import DraftCommands
        DEPTH, N = int(os.environ.get("DEPTH", 2)), int(os.environ.get("N", 8))
        mh = DraftCommands._max_hedges
        DraftCommands._max_hedges = staticmethod(lambda seq: (N if not seq.draft_paused and seq.policy.max_hedges() else 0) if NOW["label"] == "B" else mh(seq))
        may = Drafter._may_hedge.__func__
        Drafter._may_hedge = classmethod(lambda cls, seq: True if NOW["label"] == "B" else may(cls, seq))
        import duospec.draft_worker.hedges as hm2
        create = hm2.HedgeBook._create
        def _create(self, seq, key):
            hm2.HEDGE_DEPTH = DEPTH if NOW["label"] == "B" else 4
            return create(self, seq, key)
        hm2.HedgeBook._create = _create  # (drafter-side: in-process only)
    elif VARIANT == "queue":  # B: the next round is never queued at the target
        from duospec.coordinator.queued_round import QueuedRound
        candidate = QueuedRound._queue_candidate
        QueuedRound._queue_candidate = lambda self: candidate(self) if NOW["label"] == "A" else None
    elif VARIANT == "costline":  # B: the verify cost model's line alone (before session 17)
        from duospec.coordinator.adaptive import VerifyCostModel
        measured = VerifyCostModel.cost
        def line(self, n):
            fixed, per_token = self.coefficients()
            return fixed + per_token * n
        VerifyCostModel.cost = lambda self, n: measured(self, n) if NOW["label"] == "A" else line(self, n)
    elif VARIANT == "notree":  # B: chains only
        from duospec.coordinator.sequence import Sequence
        branches = Sequence.add_branches
        Sequence.add_branches = lambda self, n: branches(self, n if NOW["label"] == "A" else 0)
    elif VARIANT == "extend":  # A: a greedy model draft extended by what followed it in the text (in-process)
        from duospec.coordinator.lookup import TextLookup
        from duospec.draft_worker import model_proposer as mp
        MIN_N, EXT = int(os.environ.get("MIN_N", 3)), int(os.environ.get("EXT", 4))
        propose, rewind = mp.ModelProposer.propose, mp.ModelProposer.rewind
        LOOKUPS = {}
        def ext_propose(self, seqs, budgets):
            out = propose(self, seqs, budgets)
            if NOW["label"] != "A":
                return out
            for seq, budget, proposal in zip(seqs, budgets, out):
                if len(proposal.tokens) == 1 and seq.sampling.greedy and budget > 1:
                    look = LOOKUPS.setdefault(id(seq), TextLookup(min_ngram=MIN_N, max_ngram=8))
                    more = look.propose(seq.tokens + proposal.tokens, min(EXT, budget - 1))
                    proposal.tokens.extend(more)
            return out
        def ext_rewind(self, seq, length):
            look = LOOKUPS.get(id(seq))
            if look is not None:
                look._indexed = min(look._indexed, length)
            return rewind(self, seq, length)
        mp.ModelProposer.propose, mp.ModelProposer.rewind = ext_propose, ext_rewind
    elif VARIANT == "hedgeless":  # B: no hedges drafted; the tree keeps the runner-up siblings
        import sys
        from duospec.coordinator.draft_commands import DraftCommands
        mh = DraftCommands._max_hedges
        def patched(seq):
            n = mh(seq)
            if NOW["label"] == "B" and sys._getframe(1).f_code.co_name != "_verify_item":
                return 0
            return n
        DraftCommands._max_hedges = staticmethod(patched)
    else:
        raise SystemExit(f"VARIANT={VARIANT}: cap, tree, lookahead, empty, queue, costline, notree, extend, hedgeless or wide")
ALL = LABELS + ["off"]


def select(label):
    NOW["label"] = label
    NOW["cap"] = int(label[3:]) if label.startswith("cap") else None
    return "off" if label == "off" else "pearl"


def busy(run) -> float:
    fractions = run.busy_fractions()
    return fractions[0] if fractions else 0.0


async def passes(path, runner):
    R = collections.defaultdict(list)
    for label in ALL:  # warm-up: each variant's guard learns first
        await runner(select(label), label)
    for rep in range(REP):
        for label in (ALL if rep % 2 == 0 else ALL[::-1]):
            R[label].append(await runner(select(label), label))
        print(path, rep, " ".join(f"{l} {R[l][-1][0]:.1f}/{R[l][-1][1]:.2f}/busy {R[l][-1][2]:.2f}" for l in ALL), flush=True)
    for label in LABELS:
        ratios = [a[0] / b[0] for a, b in zip(R[label], R["off"])]
        print(f"{path} {label}: tok/s {statistics.median(r[0] for r in R[label]):.1f}, x off {statistics.median(ratios):.3f} "
              f"{[round(x, 2) for x in ratios]}, MAL {statistics.median(r[1] for r in R[label]):.2f}, "
              f"target busy {statistics.median(r[2] for r in R[label]):.2f}", flush=True)
    print(f"{path} off {statistics.median(r[0] for r in R['off']):.1f}", flush=True)


async def main():
    paths = os.environ.get("PATHS", "inproc,server" if STREAMS == 1 else "server").split(",")
    if "inproc" in paths:
        c = open_local_coordinator(pair, SpeculationDefaults())

        async def in_process(mode, v):
            run = await run_coordinator_mode(c, prompts, mode, 128, "in-process", v, variant=v)
            return run.tokens_per_s, run.mean_accepted_length or 0, busy(run)
        try:
            await passes("inproc", in_process)
        finally:
            await c.close()
    if "server" in paths:
        async with served_pipeline(pair, SpeculationDefaults(), None) as s:
            generate = s.client.generate

            async def with_cap(*a, **k):
                if NOW["cap"] is not None:
                    k["max_draft_tokens"] = NOW["cap"]
                return await generate(*a, **k)
            s.client.generate = with_cap

            async def served(mode, v):
                if STREAMS == 1:
                    run = await run_client_mode(s, prompts, mode, 128, lambda: None, variant=v)
                    return run.tokens_per_s, run.mean_accepted_length or 0, busy(run)
                s.coordinator.use_speculation_choices(v)

                async def stream(i):  # two requests back to back
                    return [await client_request(s.client, prompts[(i * 2 + j) % len(prompts)], mode, 128, s.model)
                            for j in range(2)]
                started = time.perf_counter()
                records = [r for rs in await asyncio.gather(*(stream(i) for i in range(STREAMS))) for r in rs]
                return sum(len(r.token_ids) for r in records) / (time.perf_counter() - started), 0.0, 0.0
            await passes(f"server-{STREAMS}" if STREAMS > 1 else "server", served)

asyncio.run(main())
