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
    "duospec.cli.client",     # generate, models
    "duospec.cli.admin",      # tenants, usage
    "duospec.cli.train",      # train-tiny, distill
    "duospec.cli.bench",      # bench
]


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


if __name__ == "__main__":
    sys.exit(main())
