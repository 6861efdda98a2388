"""duospec bench: the arithmetic on hand-computed timings, the summary of synthetic runs, and a smoke
run of the command on tiny random models (in-process only)."""

from __future__ import annotations

import json
import pathlib

import pytest

from duospec.bench import arithmetic as ar
from duospec.bench.records import RequestRecord, Run, WorkerWindow, window
from duospec.bench.summary import add_ideal_bound, exactness, mode_summary, sweep_medians, targets

GROUNDED = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "prompts" / "grounded.jsonl"


def test_median_odd_and_even():
    assert ar.median([3, 1, 2]) == 2
    assert ar.median([4, 1, 3, 2]) == 2.5


def test_percentile_interpolates_between_ranks():
    values = [5, 1, 4, 2, 3]
    assert ar.percentile(values, 50) == 3
    assert ar.percentile(values, 0) == 1 and ar.percentile(values, 100) == 5
    # rank (5 - 1) * 0.99 = 3.96: 4 + 0.96 * (5 - 4)
    assert ar.percentile(values, 99) == pytest.approx(4.96)
    assert ar.percentile([10, 20], 25) == pytest.approx(12.5)
    assert ar.percentile([7.0], 99) == 7.0


def test_speedup_bound_efficiency_busy_overhead():
    assert ar.tokens_per_second(640, 3.2) == pytest.approx(200.0)
    assert ar.speedup(300.0, 100.0) == pytest.approx(3.0)
    # 3 tokens per forward, 20 ms per verify forward: at best 150 tokens/s
    assert ar.ideal_overlap_tokens_per_s(3.0, 0.020) == pytest.approx(150.0)
    assert ar.efficiency(120.0, 150.0) == pytest.approx(0.8)
    assert ar.busy_fraction(0.6, 2.0) == pytest.approx(0.3)
    # 1.3 s wall, 1.2 s in the target, 100 rounds: 1 ms per round added
    assert ar.overhead_per_round_s(1.3, 1.2, 100) == pytest.approx(0.001)
    assert ar.ratio_or_none(None, 2.0) is None and ar.ratio_or_none(3.0, 2.0) == 1.5


def test_accepted_length_histogram_from_per_position_counts():
    # 10 rounds; 6 accepted position 0, 3 accepted positions 0-1, 1 accepted 0-2
    assert ar.accepted_length_histogram([6, 3, 1], 10) == [4, 3, 2, 1]
    assert ar.accepted_length_histogram([], 5) == [5]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: ar.median([]), "no values"),
        (lambda: ar.percentile([1.0], 101), "within"),
        (lambda: ar.percentile([float("nan")], 50), "finite"),
        (lambda: ar.speedup(1.0, 0.0), "baseline"),
        (lambda: ar.ideal_overlap_tokens_per_s(2.0, 0.0), "verify forward"),
        (lambda: ar.overhead_per_round_s(1.0, 0.5, 0), "no verify rounds"),
        (lambda: ar.accepted_length_histogram([2, 5], 10), "non-increasing"),
    ],
)
def test_bad_inputs_raise_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def _pearl_run(wall_s: float, tokens: list[int]) -> Run:
    # 4 verify rounds, 8 drafts sent, 6 accepted: (6 + 4) / 4 = 2.5 tokens per forward
    record = RequestRecord("p0", tokens, wall_s, drafted=8, accepted=6, target_forwards=4, accepted_per_pos=[3, 2, 1])
    return Run("pearl", "in-process", wall_s, [record], WorkerWindow(target_busy_s=0.4, target_rounds=4, draft_busy_s=0.3))


def test_mode_summary_medians_and_ideal_bound():
    runs = [_pearl_run(0.5, list(range(10))), _pearl_run(1.0, list(range(10))), _pearl_run(0.4, list(range(10)))]
    s = mode_summary(runs)
    assert s["tokens_per_s"] == pytest.approx(20.0)  # median of 20, 10, 25
    assert s["mean_accepted_length"] == pytest.approx(2.5)
    assert s["acceptance_rate"] == pytest.approx(0.75)
    assert s["verify_forward_s"] == pytest.approx(0.1)
    assert s["target_busy_fraction"] == pytest.approx(0.8)  # median of 0.8, 0.4, 1.0
    assert s["draft_busy_fraction"] == pytest.approx(0.6)  # median of 0.6, 0.3, 0.75
    assert s["accepted_length_histogram"] == [3, 3, 3, 3]  # 12 rounds; 9, 6, 3 at least 1, 2, 3
    add_ideal_bound(s, runs)
    assert s["ideal_tokens_per_s"] == pytest.approx(25.0)  # 2.5 tokens / 0.1 s, in every run
    assert s["efficiency_runs"] == pytest.approx([0.8, 0.4, 1.0])  # 20, 10, 25 tokens/s over 25
    assert s["efficiency"] == pytest.approx(0.8)


def _sweep_point(streams, mode, tokens_per_s, repeat):
    return {"mode": mode, "streams": streams, "requests": 2 * streams, "tokens": 256 * streams, "wall_s": 1.0,
            "aggregate_tokens_per_s": tokens_per_s, "all_live_tokens_per_s": tokens_per_s * 1.1,
            "tail_share": 0.1 if mode == "pearl" else 0.0, "ttft_p50_s": 0.01 * repeat, "ttft_p99_s": 0.02,
            "itl_p50_s": None, "itl_p99_s": None, "repeat": repeat}


def test_a_streamed_requests_timings_come_from_its_chunks_arrivals():
    """First token at the first chunk; each later chunk's gap shared by its tokens; no chunk, no first."""
    record = RequestRecord.streamed("p", [1, 2, 3, 4], 0.5, 3.0, [(1.0, 1), (1.5, 2), (2.5, 1)])
    assert record.first_token_s == pytest.approx(0.5) and record.wall_s == pytest.approx(2.5)
    assert record.inter_token_s == pytest.approx([0.25, 0.25, 1.0])
    assert RequestRecord.streamed("q", [], 0.0, 1.0, []).first_token_s is None


def test_all_live_rate_and_tail_share_of_a_concurrency_pass():
    """Two streams from t=0: one ends at 2 s, the other at 4 s; tokens that came after 2 s are the tail's."""
    arrivals = [(0.5, 10), (1.0, 10), (2.0, 20), (3.0, 30), (4.0, 5)]
    assert ar.all_live_tokens_per_s(arrivals, 0.0, [4.0, 2.0]) == pytest.approx(40 / 2.0)
    assert ar.tail_share(0.0, [4.0, 2.0]) == pytest.approx(0.5)
    assert ar.tail_share(0.0, [3.0, 3.0]) == 0.0


def test_sweep_medians_over_passes_and_the_8_stream_target_reads_them():
    points = [_sweep_point(s, m, v, r) for r, pass_values in enumerate([(100, 110, 800, 900), (90, 100, 950, 880),
                                                                        (120, 105, 700, 910)])
              for s, m, v in zip((1, 1, 8, 8), ("pearl", "off") * 2, pass_values)]
    rows = sweep_medians(points)
    assert [(r["streams"], r["mode"]) for r in rows] == [(1, "pearl"), (1, "off"), (8, "pearl"), (8, "off")]
    pearl8 = rows[2]
    assert pearl8["aggregate_tokens_per_s"] == 800 and pearl8["aggregate_tokens_per_s_runs"] == [800, 950, 700]
    assert pearl8["repeats"] == 3 and pearl8["ttft_p50_s"] == pytest.approx(0.01) and pearl8["itl_p50_s"] is None
    report = {"paths": {}, "overhead": [], "sweep": rows}
    at8 = next(t for t in targets(report) if t["key"] == "pearl_vs_off_at_8_streams")
    assert at8["measured"] == pytest.approx(800 / 900) and at8["met"] is False
    from duospec.bench.report import _sweep_lines

    text = "\n".join(_sweep_lines(rows))
    assert "| 8 | pearl | 800.0 | 880.0 | 10 % | 3 |" in text and "| 8 | off | 900.0 | 990.0 | 0 % | 3 |" in text
    assert ("8 streams: pearl / off 0.89 (medians; pass by pass 0.89, 1.08, 0.77); while all streams were live "
            "0.89 (medians; pass by pass 0.89, 1.08, 0.77)") in text
    assert "1 stream: pearl / off 0.95 (medians; pass by pass 0.91, 0.90, 1.14)\n" in text + "\n"
    old_report = [{k: v for k, v in row.items() if not k.startswith(("all_live", "tail"))} for row in rows]
    assert "| 8 | pearl | 800.0 | – | – | 3 |" in "\n".join(_sweep_lines(old_report))  # written before they existed


def test_exactness_names_the_diverging_prompt_and_position():
    off = Run("off", "in-process", 1.0, [RequestRecord("a", [1, 2, 3], 0.5), RequestRecord("b", [4, 5], 0.5)])
    pearl = Run("pearl", "server", 1.0, [RequestRecord("a", [1, 2, 3], 0.5), RequestRecord("b", [4, 9], 0.5)])
    result = exactness([off, pearl])
    assert result["all_identical"] is False
    entry = result["by_run"]["server/pearl"]
    assert (entry["compared"], entry["identical"]) == (2, 1)
    assert entry["mismatches"] == [{"prompt": "b", "first_divergence": 1}]


def test_worker_window_treats_unopened_scheduler_as_zero():
    before = {"models": {"bench": {"live_sequences": 0}}}
    after = {"models": {"bench": {"target": {"busy_s": 1.5, "batches": 30, "verdict_handling_s": 0.25},
                                  "draft": {"busy_s": 0.5}}}}
    w = window(before, after, "bench")
    assert (w.target_busy_s, w.target_rounds, w.draft_busy_s, w.verdict_handling_s) == (1.5, 30, 0.5, 0.25)


def _bench_smoke(tmp_path, *extra: str, draft_model: bool = True):
    """`duospec bench` on two tiny random-weight checkpoints, in-process, 2 prompts x 8 tokens."""
    from duospec.cli import main
    from tiny_models import make_tiny_checkpoint

    target = make_tiny_checkpoint(tmp_path / "target", "llama", seed=0)
    pair = ["--target", str(target)]
    if draft_model:
        pair += ["--draft", str(make_tiny_checkpoint(tmp_path / "draft", "llama", seed=1, num_layers=1))]
    out = tmp_path / "out"
    code = main(["bench", *pair, "--skip-server", "--repeats", "1",
                 "--max-new-tokens", "8", "--limit-prompts", "2", "--out", str(out), "--no-progress", *extra])
    assert code == 0
    return out


def test_off_on_two_threads_sets_and_restores_torchs_threads():
    import torch

    from duospec.bench.harness import torch_threads

    before = torch.get_num_threads()
    with torch_threads(2):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), torch_threads(2):
        raise RuntimeError("a failing run")
    assert torch.get_num_threads() == before


def test_bench_command_smoke_in_process(tmp_path):
    out = _bench_smoke(tmp_path, "--models-label", "tiny random-weight test models")
    report = json.loads((out / "results.json").read_text())
    modes = report["paths"]["in-process"]["modes"]
    assert set(modes) == {"off", "off-2threads", "hf", "hf-assisted", "vanilla", "pearl-nocache", "pearl-notree",
                          "pearl"}
    assert all(m["tokens_per_run"] == 16 and m["tokens_per_s"] > 0 for m in modes.values())
    assert modes["pearl"]["ideal_tokens_per_s"] > 0 and modes["pearl"]["target_busy_fraction"] > 0
    overhead = report["overhead"][0]
    assert overhead["path"] == "in-process" and overhead["rounds"] >= 16
    # the coordinator's handling is part of each round's overhead (a round's steps run one after another)
    assert 0 < overhead["handling_per_round_s"] <= overhead["overhead_per_round_s"]
    assert report["paths"]["in-process"]["speedups"]["pearl_vs_off_2threads"] > 0
    assert set(report["exactness"]["by_run"]) == {"in-process/off-2threads", "in-process/hf",
                                                  "in-process/hf-assisted", "in-process/vanilla",
                                                  "in-process/pearl-nocache", "in-process/pearl-notree", "in-process/pearl"}
    markdown = (out / "results.md").read_text()
    assert "tiny random-weight test models" in markdown and "| ours, pearl |" in markdown
    assert "| ours, off, target on 2 torch threads (both cores) |" in markdown and "pearl vs off on 2 threads" in markdown
    assert "of it: coordinator handling (ms)" in markdown
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("method", ["ngram", "layers:1", "random"])
def test_bench_runs_every_drafting_method(tmp_path, method):
    out = _bench_smoke(tmp_path, "--draft-method", method, "--prompts", str(GROUNDED), draft_model=method == "random")
    report = json.loads((out / "results.json").read_text())
    assert report["setup"]["config"]["draft_method"] == method
    modes = report["paths"]["in-process"]["modes"]
    assert set(modes) == {"off", "off-2threads", "hf", "hf-assisted", "vanilla", "pearl-nocache", "pearl-notree", "pearl"}  # hf-assisted: prompt lookup for ngram
    assert report["exactness"]["all_identical"] and modes["pearl"]["tokens_per_s"] > 0
    assert f"drafter {method}" in (out / "results.md").read_text()
    if method == "random":  # a random-weight copy of the draft's shape was written and used
        assert (out / "random-draft" / "config.json").is_file()


def test_bench_draft_method_errors(tmp_path, capsys):
    from duospec.cli import main

    for argv, message in ((["--draft-method", "beam"], "use model, ngram, eagle, eagle3, medusa or layers:K"),
                          (["--draft-method", "ngram", "--draft", str(tmp_path)], "loads no draft checkpoint"),
                          (["--draft-method", "ngram", "--simulate", "devices"], "--simulate replays a draft model"),
                          (["--draft-method", "eagle"], "needs the head's directory"),
                          (["--draft-method", "medusa", "--draft", str(tmp_path)], "no head.json")):
        assert main(["bench", "--target", str(tmp_path), *argv]) == 2
        assert message in capsys.readouterr().err


def test_bench_command_rejects_half_a_pair(tmp_path, capsys):
    from duospec.cli import main

    assert main(["bench", "--target", str(tmp_path)]) == 2
    assert "--target and --draft go together" in capsys.readouterr().err


def _demo_config(monkeypatch, root: pathlib.Path, target: str, draft: str) -> pathlib.Path:
    """A stand-in for deploy/examples/smollm2.yaml, which `duospec bench` reads for its default pair."""
    from duospec.cli import bench as bench_cli

    config = root / "demo.yaml"
    config.write_text(f"models:\n  - name: smollm2\n    target: {target}\n    draft: {draft}\n")
    monkeypatch.setattr(bench_cli, "DEMO_CONFIG", config)
    monkeypatch.delenv("DUOSPEC_MODELS", raising=False)
    return config


def test_bench_without_models_names_the_pull_when_smollm2_is_not_there(tmp_path, monkeypatch, capsys):
    from duospec.cli import main

    _demo_config(monkeypatch, tmp_path, str(tmp_path / "not-pulled"), "{method: ngram}")
    monkeypatch.setenv("DUOSPEC_CACHE", str(tmp_path / "cache"))
    assert main(["bench", "--skip-server"]) == 2
    err = capsys.readouterr().err
    assert "run `duospec pull smollm2` once" in err and "--models models" in err


def test_bench_defaults_to_the_pair_the_demo_serves(tmp_path, monkeypatch):
    """No models named: the demo config's target and drafter (a relative path resolved against the
    config's folder); another drafter keeps the demo's target; --models, or $DUOSPEC_MODELS as the
    image sets it, the bundled pair."""
    import argparse

    from duospec.cli import bench as bench_cli
    from tiny_models import make_tiny_checkpoint

    target = make_tiny_checkpoint(tmp_path / "target", "llama", seed=0, num_layers=2)
    shallow = make_tiny_checkpoint(tmp_path / "shallow", "llama", seed=1, num_layers=1)
    _demo_config(monkeypatch, tmp_path, str(target), "{method: layers, layers: 1, path: shallow}")
    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers())

    def resolve(*argv):
        return bench_cli.resolve_pair(parser.parse_args(["bench", *argv]))

    got = resolve()
    assert got[:3] == (pathlib.Path(target), pathlib.Path(shallow), "layers:1") and "SmolLM2-135M-Instruct" in got[3]
    assert resolve("--draft-method", "ngram")[:3] == (pathlib.Path(target), None, "ngram")
    with pytest.raises(ValueError, match="--draft-method model needs --draft DIR"):
        resolve("--draft-method", "model")
    bundled = ("models/target", "models/draft", "model", "")
    assert tuple(map(str, resolve("--models", "models"))) == bundled
    monkeypatch.setenv("DUOSPEC_MODELS", "/opt/duospec/models")
    assert resolve()[:3] == (pathlib.Path("/opt/duospec/models/target"), pathlib.Path("/opt/duospec/models/draft"),
                             "model")


def test_committed_prompt_set_is_held_out_and_documented_kinds():
    from duospec.bench.prompts import GROUNDED_HEADER, KINDS, load_prompts
    from duospec.training.corpus import is_heldout

    prompts = load_prompts()
    grounded = load_prompts(GROUNDED)
    assert {p.kind for p in prompts} | {p.kind for p in grounded} == set(KINDS)
    assert {p.kind for p in grounded} == {"grounded"}
    for prompt_set in (prompts, grounded):
        assert len({p.id for p in prompt_set}) == len(prompt_set)
    for p in prompts + grounded:
        if p.kind in ("heldout-snippet", "grounded"):
            path, line = p.source.rsplit(":", 1)
            assert is_heldout(path), f"{p.id}: {path} is in the training split"
            assert int(line) > 0
        if p.kind == "heldout-snippet":
            assert p.text.lstrip().startswith(("def ", "async def "))
        if p.kind == "grounded":  # the quoted function, then its first lines again
            quoted, restated = p.text.split(GROUNDED_HEADER)
            assert quoted.startswith(f"# {path}\n") and restated.splitlines()[0] in quoted


def test_load_prompts_names_the_bad_line(tmp_path):
    from duospec.bench.prompts import load_prompts

    bad = tmp_path / "p.jsonl"
    bad.write_text('{"id": "a", "kind": "docstring", "text": "def f():"}\n{"id": "b"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: not a prompt object"):
        load_prompts(bad)
    with pytest.raises(FileNotFoundError, match="regenerate"):
        load_prompts(tmp_path / "missing.jsonl")


def test_bench_simulate_smoke(tmp_path):
    from duospec.engine.replay import REPLAY_FILE

    out = _bench_smoke(tmp_path, "--simulate", "devices")
    report = json.loads((out / "results.json").read_text())
    simulation = report["setup"]["simulation"]
    assert simulation["scenario"] == "devices" and simulation["modes_not_simulated"] == ["hf", "hf-assisted"]
    assert simulation["target_cost"]["seconds"][0] > 0 and simulation["cost_ratio_1_token"] > 0
    assert set(report["paths"]["in-process"]["modes"]) == {"off", "vanilla", "pearl-nocache", "pearl-notree", "pearl"}
    assert report["exactness"]["all_identical"]
    assert "SIMULATED (devices)" in (out / "results.md").read_text()
    assert (out / "replay-devices" / "target" / REPLAY_FILE).is_file()


def test_the_cli_offers_every_bench_mode_and_the_ablation_maps_to_a_request():
    from duospec.bench.records import ALL_MODES, request_mode
    from duospec.cli.bench import MODES

    assert MODES == ALL_MODES
    assert request_mode("pearl-nocache") == ("pearl", False, False)
    assert request_mode("pearl-notree") == ("pearl", True, False) and request_mode("pearl") == ("pearl", None, None)


def test_bench_draft_counts_are_checked(tmp_path):
    """Vanilla's γ and pearl's cap are separate settings, each in [1, 64]; the served model gets both."""
    from duospec.bench import BenchConfig

    config = BenchConfig(target=str(tmp_path), draft=str(tmp_path), out=tmp_path, gamma=3, max_draft_tokens=9)
    spec = config.speculation()
    assert (spec.gamma, spec.max_draft_tokens, spec.max_lookahead) == (3, 9, config.max_lookahead)
    for field, value in (("gamma", 0), ("max_draft_tokens", 65)):
        bad = BenchConfig(target=str(tmp_path), draft=str(tmp_path), out=tmp_path, **{field: value})
        with pytest.raises(ValueError, match=f"--{field.replace('_', '-')}={value}"):
            bad.validate()


def test_bench_flag_defaults_are_the_served_defaults():
    """`duospec bench --gamma/--max-draft-tokens` spell out SpeculationDefaults' values (the CLI may not import
    it: it needs torch, and a client-only install builds every subcommand's help)."""
    import argparse

    from duospec.cli import bench as bench_cli
    from duospec.coordinator.config import SpeculationDefaults

    parser = argparse.ArgumentParser()
    bench_cli.register(parser.add_subparsers())
    args = parser.parse_args(["bench"])
    assert (args.gamma, args.max_draft_tokens) == (SpeculationDefaults.gamma, SpeculationDefaults.max_draft_tokens)


def test_replay_table_reaches_vanilla_and_pearl():
    from duospec.bench.simulate import table_depth

    assert table_depth(2, 3, gamma=16) >= 16 + 1  # vanilla's γ past a short pearl reach
    assert table_depth(8, 9) >= 17 + 8  # pearl: its lookahead (2·8 + 1) plus a chunk in flight


def test_the_served_runs_kv_counters_are_read_from_the_coordinator_and_reported():
    from duospec.bench.report import _kv_lines
    from duospec.bench.summary import kv_counters

    stats = {"ready": True, "models": {"bench": {
        "num_preemptions": 2, "live_sequences": 0,
        "target": {"kv_blocks": 512, "prefix_cache_queries": 400, "prefix_cache_hits": 100, "busy_s": 1.0},
        "draft": {"kv_blocks": 256, "prefix_cache_queries": 0, "prefix_cache_hits": 0}}}}
    kv = kv_counters(stats)
    assert kv == {"num_preemptions": 2,
                  "target": {"kv_blocks": 512, "prefix_cache_queries": 400, "prefix_cache_hits": 100},
                  "draft": {"kv_blocks": 256, "prefix_cache_queries": 0, "prefix_cache_hits": 0}}
    lines = _kv_lines(kv)
    assert "| target | 512 | 400 | 100 | 0.25 |" in lines and "| draft | 256 | 0 | 0 | – |" in lines
    assert any("preempted for want of KV blocks: 2" in line for line in lines)
    assert _kv_lines({}) == [] and kv_counters({"models": {}}) == {}
