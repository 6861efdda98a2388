"""The SQLite usage ledger: one file on one node (the embedded default), written by its gateway — or by
the gateways of that node, each a writer with its heartbeat. The behaviour is ledger.py's.

WAL mode with synchronous=FULL: a commit is on disk when it returns, and readers (`duospec usage`)
never block the writer. One connection, guarded by a lock held across a commit's fsync.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sqlite3
import threading
from typing import Callable, Iterator

from duospec.coordinator.tenants.ledger import (
    COLUMNS, FLUSH_INTERVAL_S, LedgerUnavailable, UsageLedger, UsageRecord, select_usage,
)

# Each migration runs once, in order, in one transaction; `schema_migrations` records what ran. A
# step is SQL, or a function of the connection for what SQL alone cannot say.


def _add_id_column(conn: sqlite3.Connection) -> None:
    """Ledgers written before rows had a server-made id: add the column (old rows keep NULL)."""
    if "id" not in _columns(conn):
        conn.execute("ALTER TABLE usage ADD COLUMN id TEXT")


def _add_owner_column(conn: sqlite3.Connection) -> None:
    if "owner" not in _columns(conn):
        conn.execute("ALTER TABLE usage ADD COLUMN owner TEXT")


_MIGRATIONS: list[tuple[int, list[str | Callable[[sqlite3.Connection], None]]]] = [
    (1, [  # the ledger as it was before versions (files from then are upgraded from here)
        """CREATE TABLE IF NOT EXISTS usage (
            id                   TEXT,            -- server-made, unique per request
            request_id           TEXT NOT NULL,   -- the client's id (or the server's when the client sent none)
            tenant               TEXT NOT NULL,
            model                TEXT NOT NULL,
            prompt_tokens        INTEGER NOT NULL,
            completion_tokens    INTEGER NOT NULL,  -- tokens the client received (none past a stop string)
            drafted              INTEGER NOT NULL,
            accepted             INTEGER NOT NULL,
            target_forwards      INTEGER NOT NULL,
            mean_accepted_length REAL NOT NULL,
            finish_reason        TEXT NOT NULL,   -- length|stop|eos|cancelled|running|interrupted, or a gRPC status name
            status_code          TEXT NOT NULL,   -- OK, RUNNING, or the gRPC status name
            started_at           REAL NOT NULL,   -- unix seconds
            finished_at          REAL NOT NULL    -- while RUNNING: the last update
        )""",
        "CREATE INDEX IF NOT EXISTS usage_tenant_time ON usage (tenant, finished_at)",
        "CREATE INDEX IF NOT EXISTS usage_finished ON usage (finished_at)",
        _add_id_column,
        "CREATE UNIQUE INDEX IF NOT EXISTS usage_id ON usage (id)",  # start() upserts on it
    ]),
    (2, [  # writers: who owns a RUNNING row (ledger.py, "Writers and crashes")
        _add_owner_column,
        "CREATE TABLE IF NOT EXISTS ledger_writers (owner TEXT PRIMARY KEY, started_at REAL NOT NULL, "
        "heartbeat_at REAL NOT NULL)",
        "CREATE INDEX IF NOT EXISTS usage_running ON usage (owner) WHERE status_code = 'RUNNING'",
    ]),
]


def _columns(conn: sqlite3.Connection) -> set[str]:
    return {row[1] for row in conn.execute("PRAGMA table_info(usage)")}


class _Tx:
    def __init__(self, conn: sqlite3.Connection):
        self.execute = conn.execute
        self.executemany = conn.executemany


class SqliteLedger(UsageLedger):
    NOW_SQL = "((julianday('now') - 2440587.5) * 86400.0)"
    ROWKEY = "rowid"
    GREATEST_SQL = "MAX"
    ERRORS = (sqlite3.Error,)

    def __init__(self, path: str | os.PathLike, flush_interval_s: float = FLUSH_INTERVAL_S, *,
                 retention_days: float | None = None, on_failure: Callable[[str], None] | None = None):
        self.path = pathlib.Path(path)
        self._lock = threading.Lock()  # guards the connection (held across a commit's fsync)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute("PRAGMA busy_timeout=5000")
            self._migrate()
        except (OSError, sqlite3.Error) as exc:
            raise LedgerUnavailable(f"ledger {self.path}: {exc}; check the path is a writable SQLite file") from None
        super().__init__(str(self.path), flush_interval_s, retention_days, on_failure)

    def _migrate(self) -> None:
        with self._transaction(immediate=True) as tx:  # the write lock first: one migrator at a time
            tx.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, "
                       "applied_at REAL NOT NULL)")
            done = {row[0] for row in tx.execute("SELECT version FROM schema_migrations")}
            for version, steps in _MIGRATIONS:
                if version in done:
                    continue
                for step in steps:
                    if callable(step):
                        step(self._conn)
                    else:
                        tx.execute(step)
                tx.execute(f"INSERT INTO schema_migrations VALUES (?, {self.NOW_SQL})", (version,))

    @contextlib.contextmanager
    def _transaction(self, immediate: bool = False) -> Iterator[_Tx]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
            try:
                yield _Tx(self._conn)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")  # one fsync

    def _close_connections(self) -> None:
        with self._lock:
            self._conn.close()


def query_sqlite(path: str | os.PathLike, tenant: str | None, since: float | None) -> list[UsageRecord]:
    """Opened read-only, so it works beside a running server; reads unmigrated ledgers too."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no usage ledger there; pass --ledger with the server's ledger path "
                                "or its postgresql:// URL")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        present = _columns(conn)
        sql, params = select_usage(tenant, since, [c if c in present else f"NULL AS {c}" for c in COLUMNS])
        rows = conn.execute(sql, params).fetchall()
    finally:
        conn.close()
    return [UsageRecord(*row) for row in rows]
