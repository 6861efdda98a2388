"""`make demo`: the bundled model pair on a local Ray cluster, three streamed code completions.

Each prompt runs twice, greedy with the same token budget: first `off` (target alone, the
reference), then `pearl` (streamed live). The line after each completion gives the pearl run's
speed, its mean accepted length, its speedup over `off` measured just before, and whether the two
outputs are token-identical (greedy speculative decoding must reproduce the target exactly).

    python -m duospec.demo [--models DIR] [--backend ray|local] [--max-new-tokens N]

The coordinator runs in this process (`coordinator.pipeline.start_pipeline`: draft and target as
Ray actors; `--backend local`: both models in-process, no Ray). Exit status 1 when a pearl output
differs from its `off` reference.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

REPO_MODELS = pathlib.Path(__file__).resolve().parents[1] / "models"
MODEL_NAME = "python-tiny"

PROMPTS = (
    'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number (fibonacci(0) == 0)."""\n',
    'def read_lines(path):\n    """Return the lines of the text file at path, without trailing newlines."""\n',
    "class Stack:\n    \"\"\"A last-in, first-out stack backed by a list.\"\"\"\n\n    def __init__(self):\n",
)


@dataclass
class RunMeasure:
    """One generation: what came out and how long it took (wall clock, first request byte to finish)."""

    mode: str
    token_ids: list[int]
    text: str
    elapsed_s: float
    finish_reason: str
    stats: Any  # coordinator.api.SpecStats

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class PromptReport:
    prompt: str
    off: RunMeasure
    pearl: RunMeasure

    @property
    def speedup(self) -> float:
        return self.pearl.tokens_per_s / self.off.tokens_per_s if self.off.tokens_per_s else 0.0

    def first_difference(self) -> int | None:
        """Index of the first token where pearl and off differ (None = identical)."""
        a, b = self.off.token_ids, self.pearl.token_ids
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return i
        return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class DemoOptions:
    models_dir: pathlib.Path
    backend: str = "ray"  # "ray" = draft and target actors on a local Ray; "local" = in-process
    max_new_tokens: int = 96
    ray_address: str | None = None
    prompts: tuple[str, ...] = field(default=PROMPTS)


def model_pair(models_dir: pathlib.Path):
    """The ModelConfig for `models_dir/target` + `models_dir/draft`, or a SystemExit naming the fix."""
    from duospec.coordinator.config import ModelConfig

    missing = [p for p in (models_dir / "target", models_dir / "draft") if not (p / "config.json").is_file()]
    if missing:
        raise SystemExit(
            f"error: no model checkpoint at {', '.join(str(p) for p in missing)} (config.json missing). "
            f"Train the bundled pair with `duospec train-tiny --out {models_dir}`, or point --models "
            "(or $DUOSPEC_MODELS) at a directory holding target/ and draft/ checkpoints."
        )
    return ModelConfig(name=MODEL_NAME, target=str(models_dir / "target"), draft=str(models_dir / "draft"))


def start_coordinator(options: DemoOptions, models: list):
    if options.backend == "local":
        from duospec.coordinator.local import LocalCoordinator

        return LocalCoordinator(models)
    from duospec.coordinator.pipeline import start_pipeline

    return start_pipeline(models, ray_address=options.ray_address)


async def run_generation(
    coordinator, tokenizer, prompt_ids: list[int], mode: str, max_new_tokens: int,
    on_text: Callable[[str], None] = lambda text: None,
) -> RunMeasure:
    """One greedy request through the coordinator; `on_text` receives the text as it is committed."""
    from duospec.coordinator.api import FinishEvent, GenerationRequest, SpeculationMode, TokensEvent
    from duospec.detokenizer import IncrementalDetokenizer

    request = GenerationRequest(
        request_id=f"demo-{mode}-{uuid.uuid4().hex[:8]}", prompt_token_ids=tuple(prompt_ids),
        max_new_tokens=max_new_tokens, mode=SpeculationMode(mode), model=MODEL_NAME,
    )
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    token_ids: list[int] = []
    finish = None
    start = time.perf_counter()
    async for event in coordinator.generate(request):
        if isinstance(event, TokensEvent):
            token_ids.extend(event.token_ids)
            on_text(detokenizer.push(event.token_ids))
        elif isinstance(event, FinishEvent):
            finish = event
    elapsed = time.perf_counter() - start
    on_text(detokenizer.flush())
    if finish is None:
        raise RuntimeError(f"the coordinator ended the {mode} stream without a FinishEvent")
    return RunMeasure(mode, token_ids, detokenizer.text, elapsed, finish.finish_reason.value, finish.stats)


def result_line(report: PromptReport) -> str:
    pearl, diff = report.pearl, report.first_difference()
    same = "yes" if diff is None else f"NO (first difference at token {diff})"
    return (
        f"[pearl] {len(pearl.token_ids)} tok in {pearl.elapsed_s:.1f} s = {pearl.tokens_per_s:.1f} tok/s"
        f" | mean accepted {pearl.stats.mean_accepted_length:.1f}"
        f" | speedup vs off {report.speedup:.1f}x | identical to off: {same}"
    )


def off_line(report: PromptReport) -> str:
    off = report.off
    return f"[off]   {len(off.token_ids)} tok in {off.elapsed_s:.1f} s = {off.tokens_per_s:.1f} tok/s (target alone)"


def summary_line(reports: list[PromptReport]) -> str:
    def rate(runs: list[RunMeasure]) -> float:
        seconds = sum(r.elapsed_s for r in runs)
        return sum(len(r.token_ids) for r in runs) / seconds if seconds else 0.0

    off_rate, pearl_rate = rate([r.off for r in reports]), rate([r.pearl for r in reports])
    drafted = sum(r.pearl.stats.drafted_tokens for r in reports)
    accepted = sum(r.pearl.stats.accepted_tokens for r in reports)
    forwards = sum(r.pearl.stats.target_forwards for r in reports)
    mean_accepted = (accepted + forwards) / forwards if forwards else 0.0
    identical = sum(r.first_difference() is None for r in reports)
    return (
        f"summary: {len(reports)} prompts | off {off_rate:.1f} tok/s | pearl {pearl_rate:.1f} tok/s"
        f" | speedup {pearl_rate / off_rate if off_rate else 0.0:.1f}x | mean accepted {mean_accepted:.2f}"
        f" | drafted {drafted}, accepted {accepted} | identical to off: {identical}/{len(reports)}"
    )


async def run_demo(options: DemoOptions, out: TextIO = sys.stdout) -> list[PromptReport]:
    from transformers import AutoTokenizer

    models = [model_pair(options.models_dir)]
    tokenizer = AutoTokenizer.from_pretrained(models[0].target)
    where = "in-process (no Ray)" if options.backend == "local" else f"Ray ({options.ray_address or 'local'})"
    print(f"duospec demo: {MODEL_NAME} from {options.models_dir} on {where} | greedy, "
          f"{options.max_new_tokens} new tokens per prompt, pearl vs off", file=out, flush=True)
    ray_was_running = _ray_running()
    coordinator = start_coordinator(options, models)
    reports: list[PromptReport] = []
    try:
        # Warm both paths once so the first timed prompt does not pay one-off start-up costs.
        warm_ids = tokenizer.encode("import os\n", add_special_tokens=True)
        for mode in ("off", "pearl"):
            await run_generation(coordinator, tokenizer, warm_ids, mode, 8)
        for index, prompt in enumerate(options.prompts, 1):
            reports.append(await _one_prompt(coordinator, tokenizer, prompt, index, options, out))
    finally:
        await coordinator.close()
        if not ray_was_running and _ray_running():
            import ray

            ray.shutdown()  # the Ray the pipeline started for us; a joined or caller's Ray stays up
    print(summary_line(reports), file=out, flush=True)
    return reports


async def _one_prompt(coordinator, tokenizer, prompt: str, index: int, options: DemoOptions, out: TextIO):
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
    print(f"\n--- prompt {index}/{len(options.prompts)} ---", file=out)
    print(prompt, end="", file=out, flush=True)
    off = await run_generation(coordinator, tokenizer, prompt_ids, "off", options.max_new_tokens)

    def show(text: str) -> None:
        out.write(text)
        out.flush()

    pearl = await run_generation(coordinator, tokenizer, prompt_ids, "pearl", options.max_new_tokens, show)
    report = PromptReport(prompt, off, pearl)
    print(file=out)
    print(off_line(report), file=out)
    print(result_line(report), file=out, flush=True)
    return report


def _ray_running() -> bool:
    if "ray" not in sys.modules:
        return False
    import ray

    return ray.is_initialized()


def parse_args(argv: list[str] | None) -> DemoOptions:
    parser = argparse.ArgumentParser(prog="python -m duospec.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=pathlib.Path,
                        default=pathlib.Path(os.environ.get("DUOSPEC_MODELS", REPO_MODELS)),
                        help="directory with target/ and draft/ (default: $DUOSPEC_MODELS or the repo's models/)")
    parser.add_argument("--backend", choices=("ray", "local"), default="ray",
                        help="ray: draft and target as Ray actors (default); local: in-process")
    parser.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    parser.add_argument("--max-new-tokens", type=int, default=96, metavar="N")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return DemoOptions(models_dir=args.models, backend=args.backend, max_new_tokens=args.max_new_tokens,
                       ray_address=args.address)


def main(argv: list[str] | None = None) -> int:
    from duospec.coordinator.api import CoordinatorError

    options = parse_args(argv)
    try:
        reports = asyncio.run(run_demo(options))
    except KeyboardInterrupt:
        return 130
    except CoordinatorError as err:
        print(f"error: {err.code}: {err}", file=sys.stderr)
        return 1
    return 0 if all(r.first_difference() is None for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
