"""What the target's hidden states on the wire cost a verify round (EAGLE/Medusa drafters).

    .venv/bin/python benchmarks/head_features.py                 # the bundled target
    .venv/bin/python benchmarks/head_features.py --target DIR --batch 8

Side by side, medians over `--repeats` rounds on one thread: a verify round of `--batch` sequences
(1 context token + `--gamma` drafts each, half of them accepted) with and without `features`, each
including what the features add after the forward on all three hops: the target's fp16 encoding and
the verdict's serialization, the coordinator's parse and its FEATURES command, the drafter's
decode into the sequence's store. Prints bytes per committed token and the overhead as a share of
the plain round.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from duospec.draft_worker.proposer import FeatureStore
from duospec.engine import SlotChunk, load_checkpoint
from duospec.internal.features_wire import features_from_proto
from duospec.internal.v1 import pearl_pb2 as pb
from duospec.target_worker.verifier import Verifier


def _round(verifier: Verifier, batch: pb.VerifyBatch, stores: list[FeatureStore]) -> float:
    started = time.perf_counter()
    wire = verifier.run(batch).SerializeToString()  # target: forward, rule, encoding
    verdicts = pb.VerdictBatch.FromString(wire)  # coordinator
    commands = pb.DraftControl(commands=[
        pb.DraftCommand(seq_id=v.seq_id, kind=pb.DRAFT_COMMAND_KIND_FEATURES, features=v.features)
        for v in verdicts.verdicts if v.HasField("features")]).SerializeToString()
    for cmd, store in zip(pb.DraftControl.FromString(commands).commands, stores):  # drafter
        store.write(*features_from_proto(cmd.features))
    return time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=Path("models/target"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--context", type=int, default=64, help="position of the round")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    target = load_checkpoint(args.target, device="cpu", dtype="float32", max_slots=args.batch)
    verifier = Verifier(target.runner)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, target.runner.vocab_size, (args.context,), generator=gen).tolist()
               for _ in range(args.batch)]
    # each sequence's prefix is cached once; every round then verifies the same position (rolled back)
    verifier.run(pb.VerifyBatch(batch_id=0, items=[
        pb.VerifyItem(seq_id=i, start_pos=0, context=p, sampling=pb.Sampling(), bonus=pb.BONUS_POLICY_SKIP)
        for i, p in enumerate(prompts)]))
    greedy = {}
    for i, p in enumerate(prompts):  # drafts: the target's own greedy tokens, the second half wrong
        logits = target.runner.forward([SlotChunk(verifier.slots[i], args.context - 1, [p[-1]])])[0]
        greedy[i] = int(logits[-1].argmax())
        target.runner.truncate(verifier.slots[i], args.context - 1)

    def batch(features: bool) -> pb.VerifyBatch:
        items = []
        for i, p in enumerate(prompts):
            drafts = [greedy[i]] * (args.gamma // 2) + [0] * (args.gamma - args.gamma // 2)
            items.append(pb.VerifyItem(seq_id=i, start_pos=args.context - 1, context=[p[-1]], draft_tokens=drafts,
                                       sampling=pb.Sampling(), features=features))
        return pb.VerifyBatch(batch_id=1, items=items)

    plain, with_features = batch(False), batch(True)
    stores = [FeatureStore() for _ in prompts]
    for store in stores:
        store.write(0, torch.zeros(args.context - 1, target.runner.config.hidden_size))
    times = {"plain": [], "features": []}
    for _ in range(args.repeats):  # interleaved, so drift hits both the same
        times["plain"].append(_round(verifier, plain, stores))
        times["features"].append(_round(verifier, with_features, stores))
    verdict = verifier.run(with_features).verdicts[0]
    committed_fed = len(verdict.features.fp16) // (2 * verdict.features.hidden_size)
    plain_ms = statistics.median(times["plain"]) * 1e3
    feat_ms = statistics.median(times["features"]) * 1e3
    print(f"target {args.target} (hidden {target.runner.config.hidden_size}), batch {args.batch}, "
          f"gamma {args.gamma}, position {args.context}, {args.repeats} rounds each")
    print(f"bytes per committed token: {len(verdict.features.fp16) // committed_fed} (fp16 x hidden size); "
          f"this round sends {committed_fed} rows per sequence")
    print(f"verify round, plain:         {plain_ms:.3f} ms (median)")
    print(f"verify round, with features: {feat_ms:.3f} ms (median)")
    print(f"overhead: {feat_ms - plain_ms:+.3f} ms = {100 * (feat_ms - plain_ms) / plain_ms:+.1f} % of a round")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
