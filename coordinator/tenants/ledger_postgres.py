"""The PostgreSQL usage ledger: one database for every gateway. The behaviour is ledger.py's.

`ledger: postgresql://user:pass@host:port/db` (or `duospec serve --ledger URL`; libpq's PGPASSWORD and
friends work too, so the password can stay out of the config). Each gateway is a writer with its own
owner id and a heartbeat each flush; rows of a gateway silent for STALE_AFTER_S are closed as
interrupted by the others. Tenants' budgets live in the same database (`shared_quotas`).
"""

from __future__ import annotations

from typing import Callable

import psycopg
from psycopg_pool import PoolTimeout

from duospec.coordinator.tenants.ledger import (
    FLUSH_INTERVAL_S, LedgerUnavailable, UsageLedger, UsageRecord, select_usage,
)
from duospec.coordinator.tenants.postgres import CONNECT_TIMEOUT_S, connect, describe, mask_url


class PostgresLedger(UsageLedger):
    NOW_SQL = "extract(epoch FROM clock_timestamp())::float8"
    ROWKEY = "ctid"
    GREATEST_SQL = "GREATEST"
    ERRORS = (psycopg.Error, PoolTimeout)

    def __init__(self, url: str, flush_interval_s: float = FLUSH_INTERVAL_S, *,
                 retention_days: float | None = None, on_failure: Callable[[str], None] | None = None):
        self.database = connect(url)
        self._quotas = None
        super().__init__(self.database.name, flush_interval_s, retention_days, on_failure)

    def _dialect(self, sql: str) -> str:
        return _placeholders(sql)

    def _transaction(self):
        return self.database.transaction()

    def shared_quotas(self, on_failure: Callable[[str], None] | None = None):
        """The tenants' budgets in this database, shared with every gateway (quota_postgres.py)."""
        from duospec.coordinator.tenants.quota_postgres import PostgresQuotas

        if self._quotas is None:
            self._quotas = PostgresQuotas(self.database, self.owner, stale_after_s=self.STALE_AFTER_S,
                                          on_failure=on_failure)
        return self._quotas

    def _close_connections(self) -> None:
        if self._quotas is not None:
            self._quotas.close()
        self.database.close()


def query_postgres(url: str, tenant: str | None, since: float | None) -> list[UsageRecord]:
    sql, params = select_usage(tenant, since)
    try:
        with psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT_S) as conn:
            rows = conn.execute(_placeholders(sql), params).fetchall()
    except psycopg.errors.UndefinedTable:
        raise LedgerUnavailable(f"ledger {mask_url(url)}: no usage table; no gateway has used this database "
                                "as its ledger yet") from None
    except psycopg.Error as exc:
        raise LedgerUnavailable(f"ledger {mask_url(url)}: {describe(exc, url)}") from None
    return [UsageRecord(*row) for row in rows]


def _placeholders(sql: str) -> str:
    """ledger.py's statements (`?`) in psycopg's style; they hold no literal '?'."""
    return sql.replace("?", "%s")
