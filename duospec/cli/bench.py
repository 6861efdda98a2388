"""`duospec bench`: tokens/s, speedups, acceptance and overlap efficiency of every mode, written as
Markdown, JSON and a PNG plot (see docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

from duospec.cluster.placement import PLACEMENTS

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
MODES = ("off", "off-2threads", "hf", "hf-assisted", "vanilla", "pearl-nocache", "pearl-notree", "pearl")  # = bench.records.ALL_MODES
SIMULATION_SCENARIOS = ("devices", "large-target", "large-pair")  # duospec.bench.simulate.SCENARIOS
DEMO_MODEL = "smollm2"  # duospec.pull.PULLABLE
DEMO_CONFIG = REPO_ROOT / "deploy" / "examples" / "smollm2.yaml"
DEMO_LABEL = "SmolLM2-135M-Instruct"


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,2,4,8") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark every decoding mode on the same prompts and models",
                              description=__doc__.splitlines()[0])
    p.add_argument("--models", type=pathlib.Path,
                   help="folder holding target/ and draft/, e.g. models (the bundled tiny pair). Default: the real "
                        "pair `make demo` serves, the pulled SmolLM2-135M-Instruct with the drafter "
                        "deploy/examples/smollm2.yaml names (another --draft-method or --draft keeps its target); "
                        "$DUOSPEC_MODELS, or an install without the repo's deploy/, the bundled pair")
    p.add_argument("--target", type=pathlib.Path, help="target checkpoint (with --draft, instead of --models)")
    p.add_argument("--draft", type=pathlib.Path, help="draft checkpoint (with --target)")
    p.add_argument("--draft-method", metavar="METHOD",
                   help="what drafts: model (the draft checkpoint, the default with --models or --draft), ngram "
                        "(model-free: matches in the prompt and output; no draft needed) or layers:K (the target's "
                        "first K layers; with --draft DIR a fine-tuned shallow draft from `duospec distill "
                        "--init-layers K`), eagle, eagle3 or medusa (a head from `duospec train-heads`, eagle3 also "
                        "a published one: --draft HEAD_DIR) or random (the adversarial case: a random-weight draft "
                        "of the --draft checkpoint's shape)")
    p.add_argument("--models-label", default="", help="what the models are, printed in the report")
    p.add_argument("--prompts", type=pathlib.Path, help="JSONL prompt set (default benchmarks/prompts/prompts.jsonl)")
    p.add_argument("--limit-prompts", type=int, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), metavar="MODE",
                   help=f"modes to run (default all: {' '.join(MODES)})")
    # Defaults: coordinator.config.SpeculationDefaults, written out here because importing it needs torch,
    # and a client-only install must still build every subcommand's help (tests/unit/test_bench.py checks they agree).
    p.add_argument("--gamma", type=int, default=4,
                   help="vanilla's (and HF assisted generation's) draft tokens per verify, γ (default 4)")
    p.add_argument("--max-draft-tokens", type=int, default=8,
                   help="pearl's most draft tokens per verify; its adaptive length picks fewer when they do not "
                        "pay (default 8)")
    p.add_argument("--skip-server", action="store_true", help="in-process only: no Ray, no gRPC server")
    p.add_argument("--concurrency", type=_int_list, default=(1, 2, 4, 8), help="streams for the sweep (1,2,4,8)")
    p.add_argument("--sweep-requests", type=int, default=2, help="requests per stream in the sweep (default 2)")
    p.add_argument("--address", help="Ray cluster to join for the server runs (default: a local Ray)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench-out"), help="output folder")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--placement", choices=PLACEMENTS, default="auto",
                   help="server runs, on GPUs: separate (a GPU each), colocated (both on one GPU) or auto "
                        "(separate with two GPUs, colocated with one)")
    p.add_argument("--simulate", choices=SIMULATION_SCENARIOS,
                   help="time the pipeline as if each model had its own device: the pair's greedy tokens replayed, "
                        "each forward sleeping for its measured cost (devices: the pair's own costs; large-target: "
                        "a 91 M-parameter random-weight target's; large-pair: 91 M and 14 M random-weight models'). "
                        "Runs off, vanilla and pearl only")
    p.add_argument("--acceptance", type=float,
                   help="with --simulate: replace the draft's choices by a synthetic drafter that agrees with the "
                        "target with this probability per token (what a better-matched pair would do)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.set_defaults(func=run_bench_command)


def resolve_pair(args: argparse.Namespace) -> tuple[pathlib.Path, pathlib.Path | None, str, str]:
    """(target, draft checkpoint or head, draft method, label for the report); the draft is None for a
    method that needs none (ngram; layers without a fine-tuned --draft).

    Without --models or --target the target is the real one `make demo` serves, and without a drafter
    named, its drafter too; where there is no demo config (an installed package, the image, which sets
    $DUOSPEC_MODELS), the bundled pair instead."""
    if args.models is None and args.target is None and demo_config() is not None:
        target, spec = demo_model()
        if args.draft_method is None and args.draft is None:
            return demo_pair(target, spec)
        method = args.draft_method or "model"
        if method in ("model", "random") and args.draft is None:
            raise ValueError(f"--draft-method {method} needs --draft DIR (a checkpoint with {DEMO_LABEL}'s tokenizer)")
        return target, args.draft, method, DEMO_LABEL
    method = args.draft_method or "model"
    label = "bundled pair" if args.models is None and args.target is None else ""
    root = args.models or pathlib.Path(os.environ.get("DUOSPEC_MODELS", REPO_ROOT / "models"))
    if method not in ("model", "random"):
        if args.target is not None and args.models is not None:
            raise ValueError("pass either --models DIR or --target, not both")
        return args.target or root / "target", args.draft, method, label
    if (args.target is None) != (args.draft is None):
        raise ValueError("--target and --draft go together; pass both, or --models DIR")
    if args.target is not None:
        if args.models is not None:
            raise ValueError("pass either --models DIR or --target/--draft, not both")
        return args.target, args.draft, method, label
    return root / "target", root / "draft", method, label


def demo_config() -> pathlib.Path | None:
    """deploy/examples/smollm2.yaml in a checkout, unless $DUOSPEC_MODELS names the pair to measure."""
    return DEMO_CONFIG if DEMO_CONFIG.is_file() and "DUOSPEC_MODELS" not in os.environ else None


def demo_model():
    """(target directory, its DraftSpec or None) of the demo config's model: the config's own target
    when it is there (what `make demo` serves), else where `duospec pull` put it."""
    from duospec.coordinator.config import load_serve_config
    from duospec.pull import pulled_model

    (model,) = [m for m in load_serve_config(DEMO_CONFIG).models if m.name == DEMO_MODEL]
    target = pathlib.Path(model.target) if pathlib.Path(model.target).is_dir() else pulled_model(DEMO_MODEL)
    if target is None:
        raise ValueError(f"the default pair is {DEMO_LABEL}, which is not pulled here: run `duospec pull "
                         f"{DEMO_MODEL}` once (or pass --models models for the bundled tiny pair)")
    return target, model.draft


def demo_pair(target: pathlib.Path, spec) -> tuple[pathlib.Path, pathlib.Path | None, str, str]:
    """The demo's target with the drafter its config names (one place says which shipped drafter is
    best), so the default figures are the ones a new user's `make demo` shows."""
    if spec is None:
        raise ValueError(f"{DEMO_CONFIG} names no drafter to benchmark; pass --draft-method METHOD")
    method = f"layers:{spec.layers}" if spec.method.value == "layers" else spec.method.value
    draft = pathlib.Path(spec.path) if spec.path else None
    where = f" ({draft.relative_to(REPO_ROOT) if draft.is_relative_to(REPO_ROOT) else draft})" if draft else ""
    return target, draft, method, f"{DEMO_LABEL}, drafter {method}{where} as {DEMO_CONFIG.name} serves it"


def run_bench_command(args: argparse.Namespace) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from duospec.bench import BenchConfig, run_bench, write_outputs
    from duospec.bench.report import exactness_line

    try:
        target, draft, method, label = resolve_pair(args)
        config = BenchConfig(
            target=str(target), draft=str(draft) if draft is not None else "", out=args.out, prompts=args.prompts, prompt_limit=args.limit_prompts,
            max_new_tokens=args.max_new_tokens, repeats=args.repeats, modes=tuple(args.modes),
            skip_server=args.skip_server, concurrency=args.concurrency, sweep_requests_per_stream=args.sweep_requests,
            device=args.device, placement=args.placement, gamma=args.gamma, max_draft_tokens=args.max_draft_tokens,
            ray_address=args.address,
            models_label=args.models_label or label,
            progress=not args.no_progress, simulate=args.simulate,
            acceptance=args.acceptance, draft_method=method,
        )
        config.validate()
    except (ValueError, FileNotFoundError) as exc:
        print(f"duospec bench: error: {exc}", file=sys.stderr)
        return 2
    report = run_bench(config)
    try:
        paths = write_outputs(report, args.out)
    except RuntimeError as exc:
        print(f"duospec bench: error: {exc}", file=sys.stderr)
        return 1
    print(paths["markdown"].read_text())
    print(exactness_line(report["exactness"]))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
