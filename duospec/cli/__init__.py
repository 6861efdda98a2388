"""`duospec` command line.

Each sub-command lives in its own module with a `register(subparsers)` function that adds its
parser(s) and sets `func`. Modules keep heavy imports (torch, ray, grpc) inside their handlers so
that `duospec --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Order is the order shown in `duospec --help`.
COMMAND_MODULES = [
    "duospec.cli.serve",      # serve
    "duospec.cli.reference",  # config-reference
    "duospec.cli.client",     # generate, models
    "duospec.cli.admin",      # tenants, usage
    "duospec.cli.train",      # train-tiny, distill
    "duospec.cli.bench",      # bench
    "duospec.cli.pull",       # pull
]


# What `duospec[serve]` adds; a base (client) install lacks them.
SERVER_SIDE_MODULES = frozenset({"torch", "transformers", "tokenizers", "safetensors", "ray", "yaml", "numpy",
                                 "starlette", "uvicorn", "prometheus_client", "tqdm", "grpc_reflection",
                                 "gguf", "accelerate"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="duospec",
        description="Speculative decoding split across machines (draft and target on separate GPUs).",
    )
    from duospec import __version__

    parser.add_argument("--version", action="version", version=f"duospec {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as exc:  # a client-only install running a server-side command
        if (exc.name or "").split(".")[0] not in SERVER_SIDE_MODULES:
            raise
        print(f"duospec {args.command}: error: this command needs the server side ({exc.name} is not "
              "installed); install it with: pip install 'duospec[serve]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
