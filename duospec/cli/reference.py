"""`duospec config-reference`: every serve-config key with its type, default, bounds and meaning
(Markdown; docs/configuration.md is its output)."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser("config-reference",
                              help="print every serve-config key: type, default, bounds, meaning (Markdown)")
    p.set_defaults(func=print_reference)


def print_reference(args: argparse.Namespace) -> int:
    from duospec.coordinator.config_reference import config_reference

    print(config_reference(), end="")
    return 0
