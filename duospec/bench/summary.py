"""From collected runs to the report: medians over repeats, ratios, the ideal bound, exactness."""

from __future__ import annotations

from duospec.bench import arithmetic as ar
from duospec.bench.records import ALL_MODES, OFF_TWO_THREADS, Run

# The targets: (key in the report's "targets", what is compared, threshold).
TARGETS = (
    ("pearl_vs_off", "pearl tokens/s over off", 2.5),
    ("pearl_vs_vanilla", "pearl tokens/s over vanilla", 1.4),
    ("pearl_vs_hf_assisted", "pearl tokens/s over transformers assisted generation", 2.0),
    ("pearl_efficiency", "pearl tokens/s over its ideal overlap bound", 0.85),
    ("pearl_vs_off_at_8_streams", "pearl aggregate tokens/s over off at 8 concurrent streams", 1.0),
    ("overhead_per_round_ms", "coordinator + gRPC overhead per verify round (ms, lower is better)", 1.0),
)


def _median_or_none(values) -> float | None:
    values = [v for v in values if v is not None]
    return ar.median(values) if values else None


def mode_summary(runs: list[Run]) -> dict:
    busy = [r.busy_fractions() for r in runs]
    summary = {
        "repeats": len(runs),
        "tokens_per_run": runs[0].tokens,
        "tokens_per_s": ar.median(r.tokens_per_s for r in runs),
        "tokens_per_s_runs": [r.tokens_per_s for r in runs],
        "wall_s": ar.median(r.wall_s for r in runs),
        "mean_accepted_length": _median_or_none(r.mean_accepted_length for r in runs),
        "acceptance_rate": _median_or_none(r.acceptance_rate for r in runs),
        "cache_hit_rate": _median_or_none(r.cache_hit_rate for r in runs),
        "tree_nodes_per_forward": _median_or_none(r.tree_nodes_per_forward for r in runs),
        "tree_hit_rate": _median_or_none(r.tree_hit_rate for r in runs),
        "hedge_tokens_per_forward": _median_or_none(r.hedge_tokens_per_forward for r in runs),
        "lookup_tokens_per_forward": _median_or_none(r.lookup_tokens_per_forward for r in runs),
        "lookup_acceptance": _median_or_none(r.lookup_acceptance for r in runs),
        "verify_forward_s": _median_or_none(r.verify_forward_s() for r in runs),
        "target_busy_fraction": _median_or_none(b[0] if b else None for b in busy),
        "draft_busy_fraction": _median_or_none(b[1] if b else None for b in busy),
        # share of greedy pearl verify rounds that verified drafts (goodput guard + adaptive length)
        "speculated_share": _median_or_none(r.workers.speculated_share if r.workers else None for r in runs),
    }
    per_pos = [sum(x) for x in zip(*(r.accepted_per_pos() for r in runs))] if runs[0].accepted_per_pos() else []
    forwards = sum(r.forwards for r in runs)
    if per_pos and forwards:
        summary["accepted_per_pos"] = per_pos
        summary["accepted_length_histogram"] = ar.accepted_length_histogram(per_pos, forwards)
    return summary


def add_ideal_bound(summary: dict, runs: list[Run]) -> None:
    """pearl's ideal overlap bound and efficiency, each run against its own bound (its accepted length
    and verify time, measured in that run, under that run's machine load), then the median over runs.

    With one stream the bound is tokens / target busy seconds, so the efficiency equals the target's
    busy fraction: two independent measurements (client-side tokens and wall time vs the seconds the
    target reports) that must agree."""
    bounds, efficiencies = [], []
    for run in runs:
        mal, fwd = run.mean_accepted_length, run.verify_forward_s()
        if mal and fwd:
            bounds.append(ar.ideal_overlap_tokens_per_s(mal, fwd))
            efficiencies.append(ar.efficiency(run.tokens_per_s, bounds[-1]))
    if bounds:
        summary["ideal_tokens_per_s"] = ar.median(bounds)
        summary["efficiency"] = ar.median(efficiencies)
        summary["efficiency_runs"] = efficiencies


SWEEP_MEASURES = ("aggregate_tokens_per_s", "all_live_tokens_per_s", "tail_share", "ttft_p50_s", "ttft_p99_s",
                  "itl_p50_s", "itl_p99_s")


def sweep_medians(points: list[dict]) -> list[dict]:
    """One row per (streams, mode), in first-seen order: the median of each measure over the sweep's
    passes, and each pass's aggregate tokens/s over the whole pass and while every stream was live
    (`aggregate_tokens_per_s_runs`, `all_live_tokens_per_s_runs`, in pass order; None in reports
    written before the second was measured)."""
    groups: dict[tuple[int, str], list[dict]] = {}
    for point in points:
        groups.setdefault((point["streams"], point["mode"]), []).append(point)
    rows = []
    for (streams, mode), group in groups.items():
        row = {"streams": streams, "mode": mode, "repeats": len(group),
               "requests": group[0]["requests"], "tokens": group[0]["tokens"]}
        for measure in SWEEP_MEASURES:
            row[measure] = _median_or_none(p.get(measure) for p in group)
        for measure in ("aggregate_tokens_per_s", "all_live_tokens_per_s"):
            row[f"{measure}_runs"] = [p.get(measure) for p in group]
        rows.append(row)
    return rows


def exactness(runs: list[Run]) -> dict:
    """Greedy outputs of every run against the first in-process `off` run, prompt by prompt."""
    reference_run = next((r for r in runs if r.mode == "off" and r.path == "in-process"), None)
    if reference_run is None:
        return {"reference": None, "note": "mode off was not run in-process: nothing to compare against"}
    reference = {rec.prompt_id: rec.token_ids for rec in reference_run.records}
    out: dict = {"reference": "off (in-process, first repeat)", "by_run": {}}
    for run in runs:
        if run is reference_run:
            continue
        key = f"{run.path}/{run.mode}"
        entry = out["by_run"].setdefault(key, {"compared": 0, "identical": 0, "mismatches": []})
        for rec in run.records:
            expected = reference[rec.prompt_id]
            entry["compared"] += 1
            if rec.token_ids == expected:
                entry["identical"] += 1
            else:
                position = next((i for i, (a, b) in enumerate(zip(rec.token_ids, expected)) if a != b),
                                min(len(rec.token_ids), len(expected)))
                entry["mismatches"].append({"prompt": rec.prompt_id, "first_divergence": position})
    out["all_identical"] = all(not e["mismatches"] for e in out["by_run"].values())
    return out


def kv_counters(stats: dict) -> dict:
    """What the served run did with the workers' KV pools, from `coordinator.stats()` at its end: per
    worker the pool's blocks and its prefix cache's queried and hit prompt positions, and the
    sequences preempted (the bench's model is the only one)."""
    from duospec.coordinator.serving.metrics import per_model_stats

    out: dict = {}
    for entry in per_model_stats(stats).values():
        out["num_preemptions"] = entry.get("num_preemptions", 0)
        for role in ("target", "draft"):
            worker = entry.get(role) or {}
            if "kv_blocks" in worker:
                out[role] = {key: worker[key] for key in ("kv_blocks", "prefix_cache_queries", "prefix_cache_hits")}
    return out


def summarise(collected, prompts) -> dict:
    paths: dict[str, dict] = {}
    for path in ("in-process", "server"):
        by_mode = {m: [r for r in collected.runs if r.path == path and r.mode == m] for m in ALL_MODES}
        modes = {m: mode_summary(rs) for m, rs in by_mode.items() if rs}
        if not modes:
            continue
        if "pearl" in modes:
            add_ideal_bound(modes["pearl"], by_mode["pearl"])
        paths[path] = {
            "modes": modes,
            "speedups": speedups({m: s["tokens_per_s"] for m, s in modes.items()}),
        }
    report = {"paths": paths, "overhead": collected.overhead, "sweep": sweep_medians(collected.sweep),
              "sweep_runs": collected.sweep,
              "exactness": exactness(collected.runs), "kv": collected.kv}
    report["targets"] = targets(report)
    return report


def targets(report: dict) -> list[dict]:
    measured: dict[str, float | None] = {}
    main = report["paths"].get("server") or report["paths"].get("in-process") or {}
    for key in ("pearl_vs_off", "pearl_vs_vanilla", "pearl_vs_hf_assisted"):
        # HF assisted only runs in-process; compare it with in-process pearl.
        source = report["paths"].get("in-process", {}) if key == "pearl_vs_hf_assisted" else main
        measured[key] = source.get("speedups", {}).get(key)
    measured["pearl_efficiency"] = main.get("modes", {}).get("pearl", {}).get("efficiency")
    at8 = {p["mode"]: p["aggregate_tokens_per_s"] for p in report["sweep"] if p["streams"] == 8}
    measured["pearl_vs_off_at_8_streams"] = ar.ratio_or_none(at8.get("pearl"), at8.get("off"))
    pipeline = next((o for o in report["overhead"] if o["path"] == "pipeline"), None)
    measured["overhead_per_round_ms"] = pipeline["overhead_per_round_s"] * 1e3 if pipeline else None
    rows = []
    for key, what, threshold in TARGETS:
        value = measured[key]
        lower_is_better = key == "overhead_per_round_ms"
        met = None if value is None else (value <= threshold if lower_is_better else value >= threshold)
        rows.append({"key": key, "what": what, "target": threshold, "measured": value, "met": met,
                     "measured_on": "in-process" if key == "pearl_vs_hf_assisted" or main is
                     report["paths"].get("in-process") else "server"})
    return rows


def speedups(tokens_per_s: dict[str, float | None]) -> dict[str, float | None]:
    """The ratios the report states, from median tokens/s by mode (None where a mode was not run)."""
    get = tokens_per_s.get
    return {
        "pearl_vs_off": ar.ratio_or_none(get("pearl"), get("off")),
        "pearl_vs_off_2threads": ar.ratio_or_none(get("pearl"), get(OFF_TWO_THREADS)),
        "vanilla_vs_off": ar.ratio_or_none(get("vanilla"), get("off")),
        "hf_assisted_vs_off": ar.ratio_or_none(get("hf-assisted"), get("off")),
        "hf_vs_off": ar.ratio_or_none(get("hf"), get("off")),
        "pearl_vs_vanilla": ar.ratio_or_none(get("pearl"), get("vanilla")),
        "pearl_vs_pearl_nocache": ar.ratio_or_none(get("pearl"), get("pearl-nocache")),
        "pearl_vs_pearl_notree": ar.ratio_or_none(get("pearl"), get("pearl-notree")),
        "pearl_vs_hf_assisted": ar.ratio_or_none(get("pearl"), get("hf-assisted")),
    }
