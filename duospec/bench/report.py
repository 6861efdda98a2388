"""Writing a benchmark report: results.json (everything), results.md (the tables), results.png
(tokens/s by mode; pearl's accepted-length histogram)."""

from __future__ import annotations

import json
import pathlib

from duospec.bench.records import ALL_MODES

MODE_LABELS = {
    "off": "ours, off (target only)",
    "off-2threads": "ours, off, target on 2 torch threads (both cores)",
    "hf": "transformers generate (target only)",
    "hf-assisted": "transformers assisted generation",
    "vanilla": "ours, vanilla speculative",
    "pearl-nocache": "ours, pearl without the speculation cache",
    "pearl-notree": "ours, pearl with the cache, no token trees",
    "pearl": "ours, pearl",
}


def _num(value, digits: int = 2, scale: float = 1.0, suffix: str = "") -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}{suffix}"


def _runs(values) -> str:
    return " / ".join(f"{v:.1f}" for v in values) if values else "–"


def _mode_table(path: str, block: dict) -> list[str]:
    lines = [f"### {path}", "",
             "| mode | tokens/s (median) | × off | mean accepted length | acceptance | cache hits | verify fwd (ms) "
             "| target busy | draft busy |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    off = block["modes"].get("off", {}).get("tokens_per_s")
    for mode in ALL_MODES:
        s = block["modes"].get(mode)
        if s is None:
            continue
        ratio = s["tokens_per_s"] / off if off else None
        lines.append(
            f"| {MODE_LABELS[mode]} | {s['tokens_per_s']:.1f} | {_num(ratio)} | {_num(s['mean_accepted_length'])} "
            f"| {_num(s['acceptance_rate'], 1, 100, ' %')} | {_num(s.get('cache_hit_rate'), 0, 100, ' %')} "
            f"| {_num(s['verify_forward_s'], 2, 1e3)} "
            f"| {_num(s['target_busy_fraction'], 0, 100, ' %')} | {_num(s['draft_busy_fraction'], 0, 100, ' %')} |"
        )
    pearl = block["modes"].get("pearl", {})
    sp = block["speedups"]
    lines += ["", f"pearl vs vanilla: {_num(sp['pearl_vs_vanilla'])}×, pearl vs pearl without the speculation cache: "
              f"{_num(sp.get('pearl_vs_pearl_nocache'))}×, without trees: {_num(sp.get('pearl_vs_pearl_notree'))}×, "
              f"pearl vs off on 2 threads: {_num(sp.get('pearl_vs_off_2threads'))}×, pearl vs HF assisted: "
              f"{_num(sp['pearl_vs_hf_assisted'])}×; pearl ideal overlap bound "
              f"{_num(pearl.get('ideal_tokens_per_s'), 1)} tokens/s, efficiency "
              f"{_num(pearl.get('efficiency'), 0, 100, ' %')}; pearl verified drafts in "
              f"{_num(pearl.get('speculated_share'), 0, 100, ' %')} of its rounds (the rest: empty rounds right after "
              f"a rejection, or target-only by the goodput guard or the adaptive length); token trees: {_num(pearl.get('tree_nodes_per_forward'))} "
              f"branch tokens per verify, {_num(pearl.get('tree_hit_rate'), 0, 100, ' %')} of verifies took a "
              f"branch; hedges' own tokens kept (past their keys: a cache hit's continuation or below a branch's "
              f"root): {_num(pearl.get('hedge_tokens_per_forward'), 3)} per verify; rounds without a draft verified "
              f"{_num(pearl.get('lookup_tokens_per_forward'))} looked-up "
              f"tokens per verify, {_num(pearl.get('lookup_acceptance'), 0, 100, ' %')} of them kept; pearl run by run {_runs(pearl.get('tokens_per_s_runs'))} tokens/s, off "
              f"{_runs(block['modes'].get('off', {}).get('tokens_per_s_runs'))} (each pearl variant's goodput guard "
              "learns from scratch in its first run and keeps what it learned in the later ones).", ""]
    return lines


def render_markdown(report: dict) -> str:
    setup = report["setup"]
    cfg, hw = setup["config"], setup["hardware"]
    simulation = setup.get("simulation")
    title = "# duospec bench"
    if simulation:
        synthetic = simulation.get("acceptance")
        title += f" — SIMULATED ({simulation['scenario']}" + (
            f", synthetic acceptance {synthetic})" if synthetic is not None else ")")
    lines = [title, ""]
    if simulation:
        lines += [f"**{simulation['what']}** Single-token cost ratio target/draft: "
                  f"{simulation['cost_ratio_1_token']}×. Not simulated (they cannot replay): "
                  f"{', '.join(simulation['modes_not_simulated']) or 'none'}.", ""]
    lines += [
             f"Models: {cfg['models_label'] or 'unlabelled'} (target `{cfg['target']}`, drafter {cfg.get('draft_method', 'model')} "
             f"`{cfg['draft'] or '-'}`).  ",
             f"Hardware: {hw['processor']}, {hw['cpu_count']} cores, device {hw['device']}"
             f"{', ' + hw['gpu'] if hw['gpu'] else ''}, one torch thread per model.  ",
             f"Prompts: {setup['prompts']} from `{setup['prompts_file']}`; greedy, {cfg['max_new_tokens']} new "
             f"tokens each (EOS ignored), vanilla γ = {cfg['gamma']}, pearl at most "
             f"{cfg.get('max_draft_tokens', cfg['gamma'])} drafts per verify (adaptive), lookahead {cfg['max_lookahead']} "
             f"(pearl's at least twice its most + 1), "
             f"{cfg['repeats']} repeats, medians." + (
                 f"  \nHead drafter: the target's hidden states travel at {setup['features_bytes_per_token']} bytes "
                 "per committed token (fp16; `benchmarks/head_features.py` measures their cost per round)."
                 if setup.get("features_bytes_per_token") else ""), ""]
    for path, block in report["paths"].items():
        lines += _mode_table(path, block)
    lines += _overhead_lines(report["overhead"]) + _sweep_lines(report["sweep"]) + _kv_lines(report.get("kv"))
    lines += _exactness_lines(report)
    lines += ["## Targets", "", "| target | threshold | measured | met |", "|---|---:|---:|---|"]
    for t in report["targets"]:
        met = {True: "yes", False: "**no**", None: "not measured"}[t["met"]]
        lines.append(f"| {t['what']} | {t['target']} | {_num(t['measured'])} | {met} |")
    return "\n".join(lines) + "\n"


def _kv_lines(kv: dict | None) -> list[str]:
    if not kv:
        return []
    lines = ["## KV cache (the server runs)", "", "| worker | KV blocks | prompt positions looked up | read from the "
             "prefix cache | hit rate |", "|---|---:|---:|---:|---:|"]
    for role in ("target", "draft"):
        if role in kv:
            w = kv[role]
            rate = w["prefix_cache_hits"] / w["prefix_cache_queries"] if w["prefix_cache_queries"] else None
            lines.append(f"| {role} | {w['kv_blocks']} | {w['prefix_cache_queries']} | {w['prefix_cache_hits']} | "
                         f"{_num(rate)} |")
    return lines + ["", f"Sequences preempted for want of KV blocks: {kv.get('num_preemptions', 0)}.", ""]


def _overhead_lines(overhead: list[dict]) -> list[str]:
    if not overhead:
        return []
    lines = ["### Overhead per verify round (mode off, one request at a time)", "",
             "| path | rounds | wall / round (ms) | target's own time / round (ms) | overhead / round (ms) "
             "| of it: coordinator handling (ms) | of it: links and waits (ms) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for o in overhead:
        handling = o.get("handling_per_round_s")  # (absent from reports written before it was measured)
        split = ("– | –" if handling is None else
                 f"{handling * 1e3:.3f} | {(o['overhead_per_round_s'] - handling) * 1e3:.3f}")
        lines.append(f"| {o['path']} | {o['rounds']} | {o['wall_per_round_s'] * 1e3:.3f} | "
                     f"{o['target_per_round_s'] * 1e3:.3f} | {o['overhead_per_round_s'] * 1e3:.3f} | {split} |")
    return lines + ["", "(*coordinator handling*: applying each verdict and sending the next batch; *links and "
                        "waits*: the rest — serialisation, transport, thread and process wake-ups, and the "
                        "coordinator's other work meanwhile, such as streaming tokens to the clients.)", ""]


def _sweep_lines(sweep: list[dict]) -> list[str]:
    if not sweep:
        return []
    lines = ["### Concurrency sweep (through the server)", "",
             "| streams | mode | aggregate tokens/s (median) | while all streams live | tail | passes | TTFT p50 (ms) "
             "| TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in sweep:
        lines.append(f"| {p['streams']} | {p['mode']} | {p['aggregate_tokens_per_s']:.1f} | "
                     f"{_num(p.get('all_live_tokens_per_s'), 1)} | {_num(p.get('tail_share'), 0, 100, ' %')} | "
                     f"{p['repeats']} | {_num(p['ttft_p50_s'], 1, 1e3)} | {_num(p['ttft_p99_s'], 1, 1e3)} | "
                     f"{_num(p['itl_p50_s'], 2, 1e3)} | {_num(p['itl_p99_s'], 2, 1e3)} |")
    lines += ["", "(*while all streams live*: aggregate tokens/s until the pass's first stream finished; *tail*: "
              "the share of the pass's wall time after that, when fewer streams share each batch.)", ""]
    by_key = {(p["streams"], p["mode"]): p for p in sweep}
    for streams in dict.fromkeys(p["streams"] for p in sweep):
        pearl, off = by_key.get((streams, "pearl")), by_key.get((streams, "off"))
        if pearl and off:
            line = (f"- {streams} stream{'s' if streams > 1 else ''}: pearl / off "
                    f"{_ratio_with_passes(pearl, off, 'aggregate_tokens_per_s')}")
            if streams > 1 and pearl.get("all_live_tokens_per_s") and off.get("all_live_tokens_per_s"):
                line += f"; while all streams were live {_ratio_with_passes(pearl, off, 'all_live_tokens_per_s')}"
            lines.append(line)
    return lines + [""]


def _ratio_with_passes(pearl: dict, off: dict, measure: str) -> str:
    passes = ", ".join(f"{a / b:.2f}" for a, b in zip(pearl[f"{measure}_runs"], off[f"{measure}_runs"]))
    return f"{pearl[measure] / off[measure]:.2f} (medians; pass by pass {passes})"


def exactness_line(exactness: dict) -> str:
    if exactness.get("reference") is None:
        return "greedy exactness: not checked (" + exactness["note"] + ")"
    parts = [f"{key} {e['identical']}/{e['compared']}" for key, e in exactness["by_run"].items()]
    verdict = "all identical to off" if exactness["all_identical"] else "MISMATCHES against off"
    return f"greedy exactness: {verdict} ({', '.join(parts)})"


def _exactness_lines(report: dict) -> list[str]:
    lines = ["### Greedy outputs vs `off`", "", exactness_line(report["exactness"]), ""]
    for key, e in report["exactness"].get("by_run", {}).items():
        for m in e["mismatches"][:5]:
            lines.append(f"- {key}: prompt {m['prompt']} diverges at generated token {m['first_divergence']}")
    return lines + [""]


def write_plot(report: dict, path: pathlib.Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(f"{path}: the plot needs matplotlib; install it with `pip install 'duospec[bench]'` "
                           "(results.json and results.md are written)") from None

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    fig, (bars, hist) = plt.subplots(1, 2, figsize=(12, 4.5))
    names, values, colours = [], [], []
    for colour, (path_name, block) in zip(("tab:blue", "tab:orange"), report["paths"].items()):
        for mode in ALL_MODES:
            if mode in block["modes"]:
                names.append(f"{mode}\n{path_name}")
                values.append(block["modes"][mode]["tokens_per_s"])
                colours.append(colour)
    bars.bar(range(len(values)), values, color=colours)
    bars.set_xticks(range(len(values)), names, fontsize=7)
    bars.set_ylabel("tokens/s (median)")
    bars.set_title("Throughput by mode (blue: in-process, orange: server)")
    pearl = report["paths"].get("in-process", {}).get("modes", {}).get("pearl", {})
    histogram = pearl.get("accepted_length_histogram")
    if histogram:
        hist.bar(range(len(histogram)), histogram, color="tab:green")
        hist.set_xlabel("draft tokens accepted in a verify round")
        hist.set_ylabel("verify rounds")
        hist.set_title("pearl: accepted length per round (in-process)")
    else:
        hist.text(0.5, 0.5, "pearl not run in-process", ha="center", va="center")
        hist.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(report: dict, out_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "results.md", "plot": out_dir / "results.png"}
    paths["json"].write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    paths["markdown"].write_text(render_markdown(report))
    write_plot(report, paths["plot"])  # last: a missing matplotlib still leaves the JSON and Markdown
    return paths
