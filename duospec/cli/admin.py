"""`duospec tenants add|list|remove` (the tenants file) and `duospec usage` (the usage ledger)."""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import time


def register(subparsers) -> None:
    tenants = subparsers.add_parser("tenants", help="manage the tenants file (API keys, weights, limits)")
    sub = tenants.add_subparsers(dest="tenants_command", metavar="ACTION", required=True)

    add = sub.add_parser("add", help="add a tenant; prints its new API key once (only the hash is stored)")
    add.add_argument("name")
    add.add_argument("--tenants", type=pathlib.Path, required=True, help="tenants file (created if missing)")
    add.add_argument("--weight", type=float, default=1.0, help="priority weight (share of the target)")
    add.add_argument("--allowed-models", default="*", help="comma-separated model names, or * (default)")
    add.add_argument("--rpm", type=int, help="requests per minute")
    add.add_argument("--tpm", type=int, help="tokens (prompt + completion) per minute")
    add.add_argument("--max-concurrent", type=int, help="concurrent streams")
    add.add_argument("--max-tokens-per-request", type=int, help="prompt + max_new_tokens per request")
    add.add_argument("--admin", action="store_true",
                     help="may see checkpoint paths and Ray node ids in ListModels (operators only)")
    add.set_defaults(func=tenants_add)

    ls = sub.add_parser("list", help="list tenants (never keys)")
    ls.add_argument("--tenants", type=pathlib.Path, required=True)
    ls.set_defaults(func=tenants_list)

    rm = sub.add_parser("remove", help="remove a tenant and all its keys")
    rm.add_argument("name")
    rm.add_argument("--tenants", type=pathlib.Path, required=True)
    rm.set_defaults(func=tenants_remove)

    usage = subparsers.add_parser("usage", help="usage per tenant and model from the server's ledger")
    usage.add_argument("--ledger", required=True,
                       help="the server's ledger: its SQLite path, or its postgresql://user:pass@host:port/db URL")
    usage.add_argument("--tenant", help="only this tenant")
    usage.add_argument("--since", help="only requests finished since: 30m, 12h, 7d, or an ISO date/time")
    usage.set_defaults(func=usage_report)


def _fail(message: str) -> int:
    print(f"duospec: error: {message}", file=sys.stderr)
    return 2


def _load(path: pathlib.Path, must_exist: bool):
    from duospec.coordinator.tenants.tenancy import load_tenants

    if not path.exists() and not must_exist:
        return []
    return load_tenants(path)


def tenants_add(args: argparse.Namespace) -> int:
    from duospec.coordinator.tenants.tenancy import Tenant, TenantLimits, TenantsFileError, hash_api_key, new_api_key, parse_tenants
    from duospec.coordinator.tenants.tenancy import dump_tenants, save_tenants

    try:
        tenants = _load(args.tenants, must_exist=False)
        if any(t.name == args.name for t in tenants):
            return _fail(f"tenant {args.name!r} already exists in {args.tenants}; `duospec tenants remove` it first")
        key = new_api_key()
        models = tuple(m.strip() for m in args.allowed_models.split(",") if m.strip()) or ("*",)
        tenant = Tenant(
            name=args.name, key_hashes=(hash_api_key(key),), allowed_models=models, priority_weight=args.weight,
            admin=args.admin,
            limits=TenantLimits(requests_per_minute=args.rpm, tokens_per_minute=args.tpm,
                                max_concurrent_streams=args.max_concurrent,
                                max_tokens_per_request=args.max_tokens_per_request),
        )
        parse_tenants(dump_tenants([tenant]), source="--options")  # same checks as the server applies
        save_tenants(args.tenants, tenants + [tenant])
    except TenantsFileError as exc:
        return _fail(str(exc))
    print(f"added tenant {args.name!r} to {args.tenants}")
    print("API key (shown once; only its hash is stored):")
    print(key)
    return 0


def tenants_list(args: argparse.Namespace) -> int:
    from duospec.coordinator.tenants.tenancy import TenantsFileError

    try:
        tenants = _load(args.tenants, must_exist=True)
    except TenantsFileError as exc:
        return _fail(str(exc))
    rows = [("NAME", "WEIGHT", "MODELS", "KEYS", "RPM", "TPM", "STREAMS", "TOKENS/REQ")]
    for t in tenants:
        lim = t.limits
        rows.append((t.name + (" (admin)" if t.admin else ""), f"{t.priority_weight:g}", ",".join(t.allowed_models),
                     str(len(t.key_hashes)),
                     *(str(v) if v else "-" for v in (lim.requests_per_minute, lim.tokens_per_minute,
                                                       lim.max_concurrent_streams, lim.max_tokens_per_request))))
    _print_table(rows)
    return 0


def tenants_remove(args: argparse.Namespace) -> int:
    from duospec.coordinator.tenants.tenancy import TenantsFileError, save_tenants

    try:
        tenants = _load(args.tenants, must_exist=True)
    except TenantsFileError as exc:
        return _fail(str(exc))
    kept = [t for t in tenants if t.name != args.name]
    if len(kept) == len(tenants):
        return _fail(f"no tenant {args.name!r} in {args.tenants}")
    save_tenants(args.tenants, kept)
    print(f"removed tenant {args.name!r} (a running server picks this up within seconds and ends its open streams)")
    return 0


def usage_report(args: argparse.Namespace) -> int:
    from duospec.coordinator.tenants.ledger import summarize
    from duospec.coordinator.tenants.ledgers import query_usage

    try:
        since = parse_since(args.since) if args.since else None
        records = query_usage(args.ledger, tenant=args.tenant, since=since)
    except (ValueError, OSError) as exc:  # (a missing file, an unreachable database: LedgerUnavailable)
        return _fail(str(exc))
    rows = [("TENANT", "MODEL", "REQUESTS", "RUNNING", "ERRORS", "PROMPT", "COMPLETION", "DRAFTED", "ACCEPTED", "ACCEPT%",
             "TOK/FWD")]
    for t in summarize(records):
        rows.append((t["tenant"], t["model"], str(t["requests"]), str(t["running"]), str(t["errors"]), str(t["prompt_tokens"]),
                     str(t["completion_tokens"]), str(t["drafted"]), str(t["accepted"]),
                     f"{100 * t['acceptance']:.1f}", f"{t['mean_accepted_length']:.2f}"))
    _print_table(rows)
    return 0


def parse_since(value: str, now: float | None = None) -> float:
    """'30m' / '12h' / '7d' / '45s' ago, or an ISO date/time (local time unless it has an offset)."""
    from datetime import datetime

    now = time.time() if now is None else now
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", value.strip())
    if m:
        return now - float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise ValueError(f"--since: {value!r}; use e.g. 30m, 12h, 7d or 2025-01-31T12:00") from None


def _print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
