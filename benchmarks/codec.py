"""protobuf vs msgpack for the internal hot-path messages, measured side by side in one run.

    python benchmarks/codec.py [--items 8] [--repeats 2000]

Each message of one verify round — the VerifyBatch the coordinator sends, the VerdictBatch that
comes back, the DraftChunkBatch the drafter streams (greedy, and sampled with q on the wire) — is
built from Python values, encoded, decoded and read back, both ways: as the protobuf message the
streams carry today, and as the equivalent msgpack map. Prints microseconds per message (median of
5 runs) and bytes on the wire. Needs `msgpack` (the `bench` extra).
"""

from __future__ import annotations

import argparse
import statistics
import time

import msgpack

from duospec.internal.v1 import pearl_pb2 as pb


def _verify_values(items: int) -> list[dict]:
    return [{"seq_id": 1000 + i, "epoch": 3, "start_pos": 412 + i, "context": [1234], "draft_tokens": [11, 12, 13, 14],
             "draft_probs": [], "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 7},
             "bonus": 1} for i in range(items)]


def _verdict_values(items: int) -> list[dict]:
    return [{"seq_id": 1000 + i, "epoch": 3, "n_accepted": 2, "kind": 1, "next_token": 99} for i in range(items)]


def _chunk_values(items: int, q_support: int) -> list[dict]:
    q = bytes(6 * q_support)
    return [{"seq_id": 1000 + i, "epoch": 3, "start_pos": 417 + i, "tokens": [55],
             "draft_probs": [q] if q_support else []} for i in range(items)]


def _proto_verify(values):
    batch = pb.VerifyBatch(batch_id=1)
    for v in values:
        item = batch.items.add(seq_id=v["seq_id"], epoch=v["epoch"], start_pos=v["start_pos"], context=v["context"],
                               draft_tokens=v["draft_tokens"], draft_probs=v["draft_probs"], bonus=v["bonus"])
        s = v["sampling"]
        item.sampling.temperature, item.sampling.top_k, item.sampling.top_p = s["temperature"], s["top_k"], s["top_p"]
        item.sampling.seed = s["seed"]
    return batch


def _proto_verdicts(values):
    return pb.VerdictBatch(batch_id=1, verdicts=[pb.Verdict(**v) for v in values])


def _proto_chunks(values):
    return pb.DraftChunkBatch(chunks=[pb.DraftChunk(**v) for v in values], busy_seconds=0.001)


CASES = {
    "VerifyBatch (coordinator -> target)": (_verify_values, _proto_verify, pb.VerifyBatch,
                                            lambda m: [list(i.draft_tokens) for i in m.items],
                                            lambda d: [i["draft_tokens"] for i in d["items"]], "items"),
    "VerdictBatch (target -> coordinator)": (_verdict_values, _proto_verdicts, pb.VerdictBatch,
                                             lambda m: [v.n_accepted for v in m.verdicts],
                                             lambda d: [v["n_accepted"] for v in d["verdicts"]], "verdicts"),
    "DraftChunkBatch, greedy (drafter -> coordinator)": (lambda n: _chunk_values(n, 0), _proto_chunks,
                                                         pb.DraftChunkBatch, lambda m: [list(c.tokens) for c in m.chunks],
                                                         lambda d: [c["tokens"] for c in d["chunks"]], "chunks"),
    "DraftChunkBatch, sampled, q of 300 tokens": (lambda n: _chunk_values(n, 300), _proto_chunks,
                                                  pb.DraftChunkBatch, lambda m: [list(c.tokens) for c in m.chunks],
                                                  lambda d: [c["tokens"] for c in d["chunks"]], "chunks"),
}


def _time(fn, repeats: int) -> float:
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        runs.append((time.perf_counter() - start) / repeats * 1e6)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=8, help="sequences per message (the verify batch size)")
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    print(f"{args.items} sequences per message; microseconds per message: build + encode + decode + read, "
          "median of 5 runs\n")
    print("| message | protobuf µs | msgpack µs | msgpack / protobuf | protobuf bytes | msgpack bytes |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (values_of, build, cls, read_pb, read_mp, key) in CASES.items():
        values = values_of(args.items)

        def with_protobuf():
            return read_pb(cls.FromString(build(values).SerializeToString()))

        def with_msgpack():
            return read_mp(msgpack.unpackb(msgpack.packb({"batch_id": 1, key: values}), raw=False))

        assert with_protobuf() == with_msgpack()
        pb_us, mp_us = _time(with_protobuf, args.repeats), _time(with_msgpack, args.repeats)
        pb_bytes = len(build(values).SerializeToString())
        mp_bytes = len(msgpack.packb({"batch_id": 1, key: values}))
        print(f"| {name} | {pb_us:.1f} | {mp_us:.1f} | {mp_us / pb_us:.2f} | {pb_bytes} | {mp_bytes} |")


if __name__ == "__main__":
    main()
