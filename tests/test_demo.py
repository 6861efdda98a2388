"""`python -m duospec.demo`: report arithmetic and formats, the missing-models error, and full runs
on a tiny random pair (in-process coordinator; Ray actors on the shared Ray instance)."""

from __future__ import annotations

import io
import re

import pytest

from duospec.coordinator.api import SpecStats
from duospec import demo
from tiny_models import make_tiny_checkpoint

PEARL_LINE = re.compile(
    r"^\[pearl\] \d+ tok in \d+\.\d s = \d+\.\d tok/s \| mean accepted \d+\.\d \| "
    r"speedup vs off \d+\.\dx \| identical to off: (yes|NO \(first difference at token \d+\))$"
)


def measure(mode: str, ids: list[int], seconds: float, **stats) -> demo.RunMeasure:
    # Every verify forward here commits its accepted drafts plus one token.
    stats.setdefault("committed_tokens", stats.get("accepted_tokens", 0) + stats.get("target_forwards", 0))
    return demo.RunMeasure(mode, ids, "", seconds, "length", SpecStats(**stats))


def test_report_speedup_and_identity():
    off = measure("off", [1, 2, 3, 4], 2.0)
    same = demo.PromptReport("p", off, measure("pearl", [1, 2, 3, 4], 0.5, drafted_tokens=4,
                                                 accepted_tokens=3, target_forwards=1))
    assert same.speedup == pytest.approx(4.0)
    assert same.first_difference() is None
    line = demo.result_line(same)
    assert line == ("[pearl] 4 tok in 0.5 s = 8.0 tok/s | mean accepted 4.0 | speedup vs off 4.0x"
                    " | identical to off: yes")
    assert PEARL_LINE.match(line)
    differs = demo.PromptReport("p", off, measure("pearl", [1, 2, 9, 4], 1.0, target_forwards=4))
    assert differs.first_difference() == 2
    assert demo.result_line(differs).endswith("identical to off: NO (first difference at token 2)")
    shorter = demo.PromptReport("p", off, measure("pearl", [1, 2], 1.0, target_forwards=2))
    assert shorter.first_difference() == 2


def test_summary_aggregates_all_prompts():
    reports = [
        demo.PromptReport("a", measure("off", [1] * 10, 1.0),
                          measure("pearl", [1] * 10, 0.5, drafted_tokens=8, accepted_tokens=6, target_forwards=4)),
        demo.PromptReport("b", measure("off", [1] * 10, 1.0),
                          measure("pearl", [2] * 10, 0.5, drafted_tokens=8, accepted_tokens=4, target_forwards=6)),
    ]
    line = demo.summary_line(reports)
    assert "off 10.0 tok/s | pearl 20.0 tok/s | speedup 2.0x | mean accepted 2.00" in line
    assert "drafted 16, accepted 10 | identical to off: 1/2" in line


def test_missing_models_names_the_path_and_the_fix(tmp_path):
    with pytest.raises(SystemExit) as info:
        demo.model_pair(tmp_path)
    message = str(info.value.code)
    assert str(tmp_path / "target") in message and "train-tiny" in message and "DUOSPEC_MODELS" in message


def test_bad_max_new_tokens_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        demo.parse_args(["--max-new-tokens", "0"])
    assert "--max-new-tokens must be >= 1" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-models")
    make_tiny_checkpoint(root / "target", "llama", seed=1, hidden_size=64, num_layers=2)
    make_tiny_checkpoint(root / "draft", "llama", seed=2, hidden_size=32, num_layers=1,
                         tokenizer_dir=root / "target")
    return root


def check_demo_output(text: str, reports: list[demo.PromptReport], n_prompts: int) -> None:
    lines = text.splitlines()
    assert lines[0].startswith("duospec demo: python-tiny from ")
    pearl_lines = [line for line in lines if line.startswith("[pearl]")]
    assert len(pearl_lines) == len(reports) == n_prompts
    assert all(PEARL_LINE.match(line) for line in pearl_lines), pearl_lines
    assert lines[-1].startswith(f"summary: {n_prompts} prompts")
    for report in reports:
        assert report.first_difference() is None, "greedy pearl must reproduce the target alone"
        assert report.pearl.text in text  # the streamed text is what the detokenizer produced
        assert report.pearl.stats.target_forwards > 0


def test_demo_in_process(tiny_pair):
    pytest.importorskip("duospec.coordinator.local", reason="LocalCoordinator (lead) not in the tree yet")
    options = demo.DemoOptions(tiny_pair, backend="local", max_new_tokens=12, prompts=demo.PROMPTS[:2])
    out = io.StringIO()
    reports = demo.asyncio.run(demo.run_demo(options, out))
    check_demo_output(out.getvalue(), reports, 2)


@pytest.mark.ray
def test_demo_on_ray(tiny_pair, ray_session):
    pytest.importorskip("duospec.coordinator.pipeline", reason="start_pipeline (lead) not in the tree yet")
    options = demo.DemoOptions(tiny_pair, backend="ray", max_new_tokens=12, prompts=demo.PROMPTS[:1])
    out = io.StringIO()
    reports = demo.asyncio.run(demo.run_demo(options, out))
    check_demo_output(out.getvalue(), reports, 1)
    assert ray_session.is_initialized(), "the demo must not shut down a Ray it did not start"
