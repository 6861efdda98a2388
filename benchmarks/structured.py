"""JSON-schema requests through the real gRPC server: `off` against `pearl`, constrained, side by side.

    .venv/bin/python benchmarks/structured.py                       # deploy/examples/smollm2.yaml's pair
    .venv/bin/python benchmarks/structured.py --repeats 3 --max-tokens 160
    .venv/bin/python benchmarks/structured.py --drafter-masks off   # pearl's drafter ignores the grammar
    .venv/bin/python benchmarks/structured.py --drafter-masks both  # with and without, side by side
    .venv/bin/python benchmarks/structured.py --concurrency 8       # 8 streams at once (schemas in turn)
    .venv/bin/python benchmarks/structured.py --modes off vanilla pearl   # vanilla beside them

The five realistic schemas of duospec/bench/schemas.py (nested objects, arrays, enums, patterns; the
slow test tests/e2e/test_structured_smollm2.py checks them for exactness), each asked in a chat prompt, greedy, modes interleaved request by request. Reported: tokens/s
per mode (medians over the requests), pearl over `off`, the mean accepted length, how many outputs
validate against their schema, whether pearl's tokens equal `off`'s (the target alone under the same
masks), and the drafter's forced-token share (grammar-forced drafts over all drafts), and per mode the target's
verify time and rows per decode batch (drafts and tree branches: what a round costs it). In-process
backend behind the real server (one process; the drafter and the target each on one torch thread).
`--drafter-masks off` serves a drafter without the tokenizer, which drafts unmasked and forces nothing
(the target still masks: the output is the same), to compare pearl with and without the drafter's side;
`both` serves the pair twice in one server (the second copy's drafter unmasked, its target read through
links to the same files) and interleaves the two request by request, so one run compares them.
`--concurrency N` sends N requests at once per mode (tokens/s is then the aggregate), and reports
the target's grammar time per verify batch and its share of the target's verify time (all of it
exposed on a CPU, where the forward does not run beside the masks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


async def _run(args) -> dict:
    import jsonschema

    from duospec.coordinator.config import ServerSettings, load_serve_config
    from duospec.coordinator.local import LocalCoordinator
    from duospec.coordinator.serving.server import DuospecServer
    from duospec.sdk.aio import AsyncClient
    from duospec.bench.schemas import QUESTIONS, SCHEMAS

    import dataclasses
    import tempfile

    import duospec.coordinator.local as local

    [model] = load_serve_config(args.config).models
    links = tempfile.TemporaryDirectory()  # the unmasked copy's target: the same files, another path
    unmasked = dataclasses.replace(model, name=f"{model.name}-unmasked", target=links.name)
    for f in pathlib.Path(model.target).expanduser().iterdir():
        (pathlib.Path(links.name) / f.name).symlink_to(f.resolve())
    variants = {"on": {"masked": model}, "off": {"unmasked": unmasked},
                "both": {"masked": model, "unmasked": unmasked}}[args.drafter_masks]

    class MaybeUnmasked(local.Drafter):  # the unmasked copy's drafter has no tokenizer: no grammar on its side
        def __init__(self, proposer, *, tokenizer_path=None, **kwargs):
            super().__init__(proposer, tokenizer_path=None if tokenizer_path == links.name else tokenizer_path,
                             **kwargs)

    local.Drafter = MaybeUnmasked
    coordinator = LocalCoordinator(list(variants.values()))
    server = DuospecServer(coordinator, ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=0))
    port = await server.start()
    await server.wait_ready(600)
    rows, groups, drafters = [], [], {}
    names = list(SCHEMAS)
    # concurrency 1: each schema on its own, modes interleaved; N: N requests at once (schemas in turn)
    batches = [[name] for name in names] if args.concurrency == 1 else [
        [names[i % len(names)] for i in range(args.concurrency)]]
    try:
        async with AsyncClient(f"127.0.0.1:{port}", timeout=600) as client:
            for name in names:  # warm every model and mode (compiles, first forwards)
                for served in variants.values():
                    for mode in args.modes:
                        await _one(client, served.name, name, QUESTIONS[name], SCHEMAS[name], mode, 16)
            for repeat in range(args.repeats):
                for batch in batches:
                    for label, served in variants.items():
                        for mode in args.modes:
                            before = _target_stats(await coordinator.stats(), served.name)
                            started = time.perf_counter()
                            results = await asyncio.gather(*(
                                _one(client, served.name, name, QUESTIONS[name], SCHEMAS[name], mode,
                                     args.max_tokens) for name in batch))
                            seconds = time.perf_counter() - started
                            after = _target_stats(await coordinator.stats(), served.name)
                            groups.append({"drafts": label, "repeat": repeat, "mode": mode, "seconds": seconds,
                                           "tokens": sum(len(r["tokens"]) for r in results),
                                           **{k: after[k] - before[k] for k in after}})
                            rows += [{"drafts": label, "repeat": repeat, "schema": name, "slot": i, "mode": mode,
                                      **r} for i, (name, r) in enumerate(zip(batch, results))]
        workers = await coordinator.worker_stats()
        drafters = {label: workers.get(served.name, {}).get("draft", {}) for label, served in variants.items()}
    finally:
        await server.shutdown(grace_period_s=1.0)
        links.cleanup()
    for row in rows:
        try:
            jsonschema.validate(json.loads(row.pop("text")), SCHEMAS[row["schema"]])
            row["valid"] = True
        except (ValueError, jsonschema.ValidationError):
            row["valid"] = False
    return {"rows": rows, "groups": groups, "drafters": drafters, "concurrency": args.concurrency,
            "modes": args.modes}


def _target_stats(stats, model: str) -> dict:
    """The model's target's cumulative verify time, batches and grammar time, from the coordinator's stats."""
    from duospec.coordinator.serving.metrics import per_model_stats

    target = per_model_stats(stats)[model].get("target", {})
    return {"busy_s": target.get("busy_s", 0.0), "batches": target.get("batches", 0),
            "grammar_s": target.get("grammar_mask_seconds", 0.0), "decode_batches": target.get("decode_batches", 0),
            "decode_rows": target.get("decode_rows", 0)}


async def _one(client, model, name, question, schema, mode, max_tokens) -> dict:
    started = time.perf_counter()
    result = await client.generate(messages=[{"role": "user", "content": question}], model=model, mode=mode,
                                   max_new_tokens=max_tokens, json_schema=schema)
    seconds = time.perf_counter() - started
    return {"tokens": list(result.token_ids), "text": result.text, "seconds": seconds,
            "tokens_per_s": len(result.token_ids) / seconds,
            "mean_accepted_length": result.stats.mean_accepted_length if result.stats else None}


def report(result: dict) -> str:
    """Each drafter variant's table; with both, pearl's masked over unmasked from the same run."""
    parts, rates = [], {}
    for label, drafter in result["drafters"].items():
        mine = {**result, "rows": [r for r in result["rows"] if r["drafts"] == label],
                "groups": [g for g in result["groups"] if g["drafts"] == label], "drafter": drafter}
        text, rates[label] = _variant_report(mine)
        parts.append(f"## drafts {label}\n\n{text}")
    if len(rates) == 2:
        parts.append("\n".join(f"{mode}, masked over unmasked drafts (same run, interleaved): "
                               f"{rates['masked'][mode] / rates['unmasked'][mode]:.2f}x" for mode in result["modes"]
                               if mode != "off"))
    return "\n\n".join(parts)


def _variant_report(result: dict) -> tuple[str, dict]:
    rows, groups, concurrency = result["rows"], result.get("groups", []), result.get("concurrency", 1)
    modes = result.get("modes", ["off", "pearl"])
    by_mode = {m: [r for r in rows if r["mode"] == m] for m in modes}
    if concurrency == 1:
        rate = {m: statistics.median(r["tokens_per_s"] for r in rs) for m, rs in by_mode.items()}
    else:  # the aggregate: all the streams' tokens over the wall time, median over the repeats
        rate = {m: statistics.median(g["tokens"] / g["seconds"] for g in groups if g["mode"] == m) for m in by_mode}
    off_tokens = {(r["repeat"], r["schema"], r.get("slot", 0)): r["tokens"] for r in by_mode["off"]}
    drafter = result["drafter"]
    forced = drafter.get("grammar_forced_tokens")
    drafted = drafter.get("tokens_drafted") or drafter.get("drafted_tokens")
    lines = [
        f"{concurrency} stream(s) at once" + ("" if concurrency == 1 else "; tokens/s: all streams together"),
        "",
        "| mode | tokens/s (median) | × off | mean accepted length | valid |",
        "|---|---:|---:|---:|---:|",
        *(f"| {m} | {rate[m]:.1f} | {rate[m] / rate['off']:.2f} | "
          f"{statistics.mean(r['mean_accepted_length'] or 1.0 for r in rs):.2f} | "
          f"{sum(r['valid'] for r in rs)}/{len(rs)} |" for m, rs in by_mode.items()),
        "",
    ]
    for mode in modes[1:]:
        same = sum(r["tokens"] == off_tokens[(r["repeat"], r["schema"], r.get("slot", 0))] for r in by_mode[mode])
        lines.append(f"{mode}'s tokens equal off's (the target alone under the same masks): {same}/{len(by_mode[mode])}")
    if forced is not None and drafted:
        lines.append(f"drafter: {forced} grammar-forced draft tokens of {drafted} drafted ({forced / drafted:.0%})")
    for mode in by_mode:
        mine = [g for g in groups if g["mode"] == mode]
        busy, batches, grammar = (sum(g[k] for g in mine) for k in ("busy_s", "batches", "grammar_s"))
        decode_batches, decode_rows = (sum(g[k] for g in mine) for k in ("decode_batches", "decode_rows"))
        if batches and busy:
            lines.append(f"target, {mode}: grammar masks {1e3 * grammar / batches:.2f} ms per verify batch of "
                         f"{1e3 * busy / batches:.1f} ms ({grammar / busy:.1%} of its verify time)"
                         + (f"; {decode_rows / decode_batches:.1f} rows per decode batch" if decode_batches else ""))
    return "\n".join(lines), rate


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=pathlib.Path, default=REPO / "deploy" / "examples" / "smollm2.yaml")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--out", type=pathlib.Path, help="write the rows as JSON here")
    parser.add_argument("--concurrency", type=int, default=1, help="requests at once per mode")
    parser.add_argument("--modes", nargs="+", default=["off", "pearl"], choices=["off", "vanilla", "pearl"],
                        help="modes run side by side, `off` first (default: off pearl; vanilla drafts and "
                             "verifies in turn, so its drafter never runs beside the target)")
    parser.add_argument("--drafter-masks", choices=["on", "off", "both"], default="on",
                        help="on: the drafter masks its proposals and drafts forced tokens (default); off: it "
                             "drafts unmasked; both: each, side by side in one server")
    args = parser.parse_args(argv)
    if args.modes[0] != "off" or len(set(args.modes)) != len(args.modes):
        parser.error("--modes: `off` first (the baseline), each mode once")
    import torch

    torch.set_num_threads(1)
    result = asyncio.run(_run(args))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
