"""`duospec generate` and `duospec models`: the SDK from the command line.

`generate` streams the completion to stdout as it arrives and ends with one stats line on stderr,
so `duospec generate ... > out.py` captures only the text. Errors print `error: CODE: message` and
exit 1 (never a traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DEFAULT_ADDRESS = "127.0.0.1:50051"
API_KEY_ENV = "DUOSPEC_API_KEY"


def _add_connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=os.environ.get("DUOSPEC_ADDRESS", DEFAULT_ADDRESS),
                        help=f"server HOST:PORT (default: $DUOSPEC_ADDRESS or {DEFAULT_ADDRESS})")
    parser.add_argument("--api-key", default=None, help=f"API key (default: ${API_KEY_ENV})")
    parser.add_argument("--tls", action="store_true", help="use TLS (system root certificates)")
    parser.add_argument("--tls-ca", metavar="PEM", default=None,
                        help="use TLS trusting this root certificate file (implies --tls)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="deadline for the whole call (default: none)")


def register(subparsers) -> None:
    gen = subparsers.add_parser("generate", help="stream a completion from a duospec server",
                                description="Stream a completion; stats go to stderr.")
    gen.add_argument("prompt", help='prompt text ("-" reads it from stdin)')
    gen.add_argument("--max-tokens", type=int, default=None, metavar="N",
                     help="max new tokens (default: the server's)")
    gen.add_argument("--mode", choices=("pearl", "vanilla", "off"), default=None,
                     help="speculation mode (default: the model's)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="1.0 = off (default)")
    gen.add_argument("--seed", type=int, default=None, help="seed for sampling (default: random)")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop string (repeatable)")
    gen.add_argument("--model", default="", help="model name (default: the server's first)")
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="SCHEMA", default=None,
                       help="the output must be JSON valid under this schema (JSON text, or @FILE)")
    shape.add_argument("--regex", metavar="REGEX", default=None, help="the output must match this regex")
    shape.add_argument("--grammar", metavar="LARK", default=None,
                       help="the output must match this Lark grammar (text, or @FILE)")
    _add_connection_args(gen)
    gen.set_defaults(func=generate_command)

    models = subparsers.add_parser("models", help="list the models a duospec server serves")
    models.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_connection_args(models)
    models.set_defaults(func=models_command)


def _client(args):
    from duospec.sdk import Client

    tls = args.tls_ca if args.tls_ca else bool(args.tls)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    return Client(args.address, api_key=api_key, tls=tls, timeout=args.timeout)


def _fail(error) -> int:
    print(f"error: {error}", file=sys.stderr)
    return 1


def stats_line(n_tokens: int, elapsed_s: float, final) -> str:
    """`42 tokens in 1.30 s = 32.3 tok/s | mean accepted 2.41 | drafted 40 | accepted 25 | ...`"""
    rate = n_tokens / elapsed_s if elapsed_s > 0 else 0.0
    parts = [f"{n_tokens} tokens in {elapsed_s:.2f} s = {rate:.1f} tok/s"]
    stats = final.stats if final is not None else None
    if stats is not None:
        parts += [
            f"mean accepted {stats.mean_accepted_length:.2f}",
            f"drafted {stats.drafted_tokens}",
            f"accepted {stats.accepted_tokens}",
            f"pre-verify aborts {stats.pre_verify_aborts}",
        ]
        if stats.cache_lookups:
            parts.append(f"cache hits {stats.cache_hits}/{stats.cache_lookups}")
        if stats.hedge_tokens_kept:
            parts.append(f"hedge tokens kept {stats.hedge_tokens_kept}")
    if final is not None and final.finish_reason:
        parts.append(f"finish {final.finish_reason}")
    return " | ".join(parts)


def _text_or_file(value: str | None) -> str | None:
    """`@path` reads the file (a schema or grammar is rarely typed on a command line)."""
    if value is None or not value.startswith("@"):
        return value
    with open(value[1:], encoding="utf-8") as f:
        return f.read()


def generate_command(args) -> int:
    from duospec.sdk import DuospecError

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    n_tokens, final, wrote_text = 0, None, False
    try:
        with _client(args) as client:
            start = time.perf_counter()
            with client.generate(
                prompt, model=args.model, max_new_tokens=args.max_tokens, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop, mode=args.mode,
                json_schema=_text_or_file(args.json_schema), regex=args.regex, grammar=_text_or_file(args.grammar),
                stream=True,
            ) as stream:
                for chunk in stream:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    wrote_text = wrote_text or bool(chunk.text)
                    n_tokens += len(chunk.token_ids)
                    final = chunk
            elapsed = time.perf_counter() - start
    except DuospecError as err:
        if wrote_text:
            print(flush=True)  # end the partial line so the error stands alone
        return _fail(err)
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(stats_line(n_tokens, elapsed, final), file=sys.stderr)
    return 0


def models_command(args) -> int:
    import dataclasses
    import json

    from duospec.sdk import DuospecError

    try:
        with _client(args) as client:
            cards = client.models()
    except DuospecError as err:
        return _fail(err)
    if args.json:
        print(json.dumps([dataclasses.asdict(card) for card in cards], indent=2))
        return 0
    _print_table(("NAME", "MODE", "VOCAB", "CONTEXT", "DRAFTER", "TARGET", "DRAFT", "TARGET NODE", "DRAFT NODE"), [
        (c.name, c.default_mode, str(c.vocab_size), str(c.max_context), c.draft_method or "-", c.target,
         c.draft or "-", c.target_node_id or "-", c.draft_node_id or "-")
        for c in cards
    ])
    replicas = [(c.name, r) for c in cards for r in c.replicas]  # an admin's key sees them
    if replicas:
        print()
        _print_table(("MODEL", "REPLICA", "STATE", "LIVE", "OUTSTANDING", "RESTARTS (T/D)", "TARGET NODE", "DRAFT NODE"), [
            (name, str(r.index), r.state, str(r.live_sequences), str(r.outstanding_tokens),
             f"{r.target_restarts}/{r.draft_restarts}", r.target_node_id or "-", r.draft_node_id or "-")
            for name, r in replicas
        ])
    return 0


def _print_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    rows = [header, *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())

