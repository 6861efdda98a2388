"""Drafters side by side in one run: the bundled draft model next to the target's EAGLE and Medusa heads.

    .venv/bin/python benchmarks/drafter_compare.py --limit-prompts 6 --repeats 3
    .venv/bin/python benchmarks/drafter_compare.py --skip-server          # in-process only (no Ray)
    .venv/bin/python benchmarks/drafter_compare.py --drafter model=model:models/draft \
        --drafter eagle=eagle:models/eagle --skip-in-process                                    # server only
    .venv/bin/python benchmarks/drafter_compare.py --target ~/.cache/duospec/models/smollm2-135m-instruct \
        --drafter new=model:models/smollm2/draft --drafter old=model:OLD_DRAFT \
        --drafter eagle3=eagle3:models/smollm2/eagle3 --limit-prompts 4 --repeats 2     # any drafters, labelled
    .venv/bin/python benchmarks/drafter_compare.py --target ~/.cache/duospec/models/smollm2-135m-instruct \
        --drafter lookup=model:models/smollm2/draft --drafter plain=model:models/smollm2/draft \
        --set plain.context_lookup=false                # one drafter with another `draft:` key (DraftSpec)

For each drafter a coordinator (in-process) or a model of one Ray pipeline + gRPC server (server
path: each drafter is its own model there, with its own target actor) is open for the whole run, so
every repeat runs `off`, then `vanilla` and `pearl` with each drafter, in turn, on the same prompts
(greedy, EOS ignored): drift on a shared machine hits all of them alike.
Prints per path and drafter the median tokens/s over repeats, × off, the mean accepted length
(committed tokens per target forward) and whether the output equals `off`'s token for token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DRAFTERS = [f"model=model:{REPO / 'models' / 'draft'}", f"eagle=eagle:{REPO / 'models' / 'eagle'}",
                    f"medusa=medusa:{REPO / 'models' / 'medusa'}"]  # LABEL=METHOD:DIR, the bundled pair's


def _drafter(spec: str) -> tuple[str, tuple[str, Path]]:
    label, sep, rest = spec.partition("=")
    method, sep2, path = rest.partition(":")
    if not (sep and sep2 and label and method and path):
        raise argparse.ArgumentTypeError(f"{spec!r}: write LABEL=METHOD:DIR, e.g. new=model:models/smollm2/draft")
    return label, (method, Path(path).expanduser())


def _option(spec: str) -> tuple[str, str, object]:
    import dataclasses
    import json

    from duospec.draft_worker.proposer import DraftSpec

    target, sep, raw = spec.partition("=")
    label, dot, key = target.partition(".")
    keys = {f.name for f in dataclasses.fields(DraftSpec)}
    if not (sep and dot and label) or key not in keys:
        raise argparse.ArgumentTypeError(f"{spec!r}: write LABEL.KEY=VALUE with KEY one of {', '.join(sorted(keys))}")
    try:
        return label, key, json.loads(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r}: the value is not JSON (true, false, a number)") from None


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=REPO / "models" / "target")
    parser.add_argument("--drafter", action="append", type=_drafter, metavar="LABEL=METHOD:DIR",
                        help="a drafter to compare (repeat it); default: the bundled draft model, EAGLE and Medusa heads")
    parser.add_argument("--limit-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=["vanilla", "pearl"], choices=["vanilla", "pearl"])
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30,
                        help="each worker's KV pool (default 1 GiB: several pipelines share the machine's memory)")
    parser.add_argument("--set", action="append", default=[], type=_option, metavar="LABEL.KEY=VALUE",
                        help="a `draft:` key of one drafter (JSON value), e.g. plain.context_lookup=false (repeat it)")
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--skip-in-process", action="store_true")
    args = parser.parse_args(argv)
    args.drafters = dict(args.drafter or [_drafter(d) for d in DEFAULT_DRAFTERS])  # label -> (method, dir)
    args.options = {}  # label -> {DraftSpec field: value}
    for label, key, value in args.set:
        if label not in args.drafters:
            parser.error(f"--set {label}.{key}: no --drafter has the label {label!r}")
        args.options.setdefault(label, {})[key] = value
    for label, options in args.options.items():  # checked as a serve config's `draft:` mapping is
        from duospec.coordinator.config import ConfigError, parse_serve_config

        method, directory = args.drafters[label]
        draft = {"method": method, **({} if method == "ngram" else {"path": str(directory)}), **options}
        try:
            parse_serve_config({"models": [{"name": label, "target": str(args.target), "draft": draft}]},
                               source="--set")
        except ConfigError as exc:
            parser.error(str(exc))
    return args


def _summary(runs) -> tuple[float, float, list[list[int]]]:
    """(median tokens/s, mean accepted length, the tokens of the first run) of one mode's repeats."""
    rate = statistics.median(r.tokens_per_s for r in runs)
    tokens = sum(r.tokens for r in runs)
    forwards = sum(rec.target_forwards for r in runs for rec in r.records)
    return rate, tokens / max(forwards, 1), [rec.token_ids for rec in runs[0].records]


async def _measure(path: str, args, prompts) -> dict:
    """{(drafter, mode): [Run per repeat]}; `off` runs on each drafter's own coordinator or pipeline."""
    from duospec.bench.inprocess import BenchPair, open_local_coordinator, run_coordinator_mode
    from duospec.bench.served import run_client_mode, served_pipelines
    from duospec.coordinator.api import SpeculationMode
    from duospec.coordinator.config import SpeculationDefaults

    # one γ for every mode here: the drafters are compared, not the modes
    speculation = SpeculationDefaults(mode=SpeculationMode.PEARL, max_draft_tokens=args.gamma, gamma=args.gamma,
                                      max_lookahead=2 * args.gamma + 1)

    def pair(name):
        method, directory = args.drafters[name]
        return BenchPair(str(args.target), str(directory), "cpu", method,
                         kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                         draft_options=tuple(args.options.get(name, {}).items()))

    async def run(handle, mode, subset, tokens):
        if path == "in-process":
            return await run_coordinator_mode(handle, subset, mode, tokens, path, mode)
        return await run_client_mode(handle, subset, mode, tokens, lambda: None)

    async def repeats(handles: dict, runs: dict) -> None:
        for handle in handles.values():  # warm-up, untimed
            for mode in ("off", *args.modes):
                await run(handle, mode, prompts[:1], 8)
        for _ in range(args.repeats):
            for name, handle in handles.items():
                for mode in ("off", *args.modes):
                    runs.setdefault((name, mode), []).append(await run(handle, mode, prompts, args.max_new_tokens))

    runs: dict[tuple[str, str], list] = {}
    if path == "in-process":  # every drafter's coordinator open at once: repeats interleave them
        async with contextlib.AsyncExitStack() as stack:
            handles = {}
            for name in args.drafters:
                handles[name] = open_local_coordinator(pair(name), speculation)
                stack.push_async_callback(handles[name].close)
            await repeats(handles, runs)
    else:  # one Ray pipeline and server with a model per drafter: repeats interleave them too
        pairs = {name: pair(name) for name in args.drafters}
        async with served_pipelines(pairs, speculation, None) as served:
            await repeats(served, runs)
    return runs


def main(argv=None) -> int:
    import torch

    from duospec.bench.inprocess import encode_prompts
    from duospec.bench.prompts import DEFAULT_PROMPTS, load_prompts
    from duospec.engine import load_tokenizer

    args = _parse(argv)
    for name, (_, directory) in args.drafters.items():
        if not directory.exists():
            print(f"{name}: {directory} does not exist", file=sys.stderr)
            return 2
    torch.set_num_threads(1)
    prompts = encode_prompts(load_tokenizer(str(args.target)), load_prompts(DEFAULT_PROMPTS, args.limit_prompts), 256)
    paths = (() if args.skip_in_process else ("in-process",)) + (() if args.skip_server else ("server",))
    for path in paths:
        runs = asyncio.run(_measure(path, args, prompts))
        print(f"\n{path}: {len(prompts)} prompts x {args.max_new_tokens} tokens, greedy, {args.repeats} repeats, "
              f"medians; x off = over `off` on the same drafter's coordinator/pipeline")
        print("| drafter | mode | tok/s | x off | mean accepted length | greedy = off |")
        print("|---|---|---:|---:|---:|---|")
        for (name, mode), group in runs.items():
            off_rate, _, off_tokens = _summary(runs[(name, "off")])
            rate, mean_len, tokens = _summary(group)
            same = "yes" if tokens == off_tokens else "**NO**"
            print(f"| {name} | {mode} | {rate:.1f} | {rate / off_rate:.2f} | {mean_len:.2f} | {same} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
