"""Which usage ledger a location names (coordinator/tenants/ledger.py has the one behaviour both share):
a `postgresql://user:pass@host:port/db` URL is the PostgreSQL ledger that several gateways share
(ledger_postgres.py), anything else a SQLite file (ledger_sqlite.py)."""

from __future__ import annotations

import os
from typing import Callable

from duospec.coordinator.tenants.ledger import FLUSH_INTERVAL_S, UsageLedger, UsageRecord


def is_postgres_url(location: str | os.PathLike) -> bool:
    return isinstance(location, str) and location.startswith(("postgresql://", "postgres://"))


def open_ledger(location: str | os.PathLike, flush_interval_s: float = FLUSH_INTERVAL_S, *,
                retention_days: float | None = None, on_failure: Callable[[str], None] | None = None) -> UsageLedger:
    """A `postgresql://user:pass@host:port/db` URL: the PostgreSQL ledger; anything else: a SQLite file.
    Raises LedgerUnavailable (its message names the location, password masked) when it cannot open."""
    if is_postgres_url(location):
        from duospec.coordinator.tenants.ledger_postgres import PostgresLedger

        return PostgresLedger(str(location), flush_interval_s, retention_days=retention_days, on_failure=on_failure)
    from duospec.coordinator.tenants.ledger_sqlite import SqliteLedger

    return SqliteLedger(location, flush_interval_s, retention_days=retention_days, on_failure=on_failure)


def check_ledger(location: str | os.PathLike) -> None:
    """Opens (migrating it) and closes the ledger, so a bad location fails before anything slow starts.
    Raises LedgerUnavailable."""
    open_ledger(location).close()


def query_usage(location: str | os.PathLike, tenant: str | None = None, since: float | None = None) -> list[UsageRecord]:
    """Rows ordered by finish time, from either ledger; read-only, so it works beside running gateways."""
    if is_postgres_url(location):
        from duospec.coordinator.tenants.ledger_postgres import query_postgres

        return query_postgres(str(location), tenant, since)
    from duospec.coordinator.tenants.ledger_sqlite import query_sqlite

    return query_sqlite(location, tenant, since)
