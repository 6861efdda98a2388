"""Usage ledger: one SQLite row per request, written when it is admitted and kept current while it streams.

A row's life: `start()` inserts it as the request is admitted (status RUNNING), `progress()` notes
the tokens delivered so far, and a flusher thread writes every stream's latest progress in one
transaction each `flush_interval_s` (1 s): one fsync per second for the whole server, however many
streams are open. `finish()` writes the final row at once. WAL mode with synchronous=FULL: what a
write committed is on disk, so a `kill -9` of the server (or a power cut) loses at most the last
second of a stream's usage and never a row. Rows are keyed by a server-made unique `id`; the
client's request id is kept as `request_id` (clients may reuse theirs). A resumed stream (a client
continuing a broken one, coordinator/serving/resume.py) writes its broken stream's row, so the request
is charged once, for the most tokens any of its streams sent.

A row still RUNNING when a server opens the ledger was cut off by a crash: it is closed then as
finish_reason `interrupted`, status UNAVAILABLE, keeping the tokens it had delivered. One server
writes one ledger file. Readers (`duospec usage`) never block the writer.

Writes run on the ledger's own thread (`start_async`, `finish_async`), never on the executor that
tokenizes prompts: a slow disk delays usage rows, not requests. Rows finished more than
`retention_days` ago are deleted once an hour, in small batches. A failed write never fails a request:
it is logged and reported to `on_failure(operation)` (the server counts it in
`duospec:ledger_write_failures`), so an operator can alert on it.
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple, dataclass, fields
from typing import Callable

log = logging.getLogger("duospec.ledger")

RUNNING = "RUNNING"  # status_code of a row whose request is still streaming
FLUSH_INTERVAL_S = 1.0
RETENTION_INTERVAL_S = 3600.0  # how often rows past the retention are deleted
_RETENTION_BATCH = 5000  # rows per delete: a short transaction, so writes in between never wait long

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
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
    finish_reason        TEXT NOT NULL,   -- length|stop|eos|cancelled|running|interrupted, or the gRPC status name
    status_code          TEXT NOT NULL,   -- OK, RUNNING, or the gRPC status name
    started_at           REAL NOT NULL,   -- unix seconds
    finished_at          REAL NOT NULL    -- while RUNNING: the last update
);
CREATE INDEX IF NOT EXISTS usage_tenant_time ON usage (tenant, finished_at);
CREATE INDEX IF NOT EXISTS usage_finished ON usage (finished_at);
"""


@dataclass(frozen=True)
class UsageRecord:
    id: str
    request_id: str
    tenant: str
    model: str
    prompt_tokens: int
    completion_tokens: int
    drafted: int
    accepted: int
    target_forwards: int
    mean_accepted_length: float
    finish_reason: str
    status_code: str
    started_at: float
    finished_at: float


_COLUMNS = [f.name for f in fields(UsageRecord)]
_INSERT = f"INSERT INTO usage ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
# A resumed stream (its client sends back the tokens it has) rewrites its broken stream's row: the
# row keeps the first stream's started_at, and the most tokens any of them sent.
_UPDATED = [c for c in _COLUMNS if c not in ("id", "started_at")]
_SET = ", ".join("completion_tokens = MAX(completion_tokens, ?)" if c == "completion_tokens" else f"{c} = ?"
                 for c in _UPDATED)
_UPDATE = f"UPDATE usage SET {_SET} WHERE id = ? AND tenant = ?"
# start() is an upsert: a resumed stream takes over its broken stream's row (same id) if the row is
# the same tenant's; started_at stays the first stream's.
_START = (_INSERT + " ON CONFLICT (id) DO UPDATE SET "
          + ", ".join("completion_tokens = MAX(completion_tokens, excluded.completion_tokens)"
                      if c == "completion_tokens" else f"{c} = excluded.{c}"
                      for c in _UPDATED)
          + " WHERE usage.tenant = excluded.tenant")
# Progress never overwrites a finished row (a flush racing the request's end).
_PROGRESS = _UPDATE + f" AND status_code = '{RUNNING}'"
_EXPIRE = (f"DELETE FROM usage WHERE rowid IN (SELECT rowid FROM usage WHERE finished_at < ? "
           f"AND status_code != '{RUNNING}' LIMIT {_RETENTION_BATCH})")


class UsageLedger:
    """`retention_days`: rows finished longer ago are deleted (None or 0: kept). `on_failure(operation)`:
    told of every failed write ("start", "finish", "progress" or "retention") after it is logged."""

    def __init__(self, path: str | pathlib.Path, flush_interval_s: float = FLUSH_INTERVAL_S, *,
                 retention_days: float | None = None, on_failure: Callable[[str], None] | None = None):
        self.path = pathlib.Path(path)
        self.retention_days = retention_days or None
        self.on_failure = on_failure
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # guards the connection (held across a commit's fsync)
        self._pending_lock = threading.Lock()  # guards _pending only: progress() never waits for an fsync
        self._conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA busy_timeout=5000")
        self._conn.executescript(_SCHEMA)
        self._migrate()
        self._conn.execute(
            "UPDATE usage SET finish_reason = 'interrupted', status_code = 'UNAVAILABLE' WHERE status_code = ?",
            (RUNNING,),
        )
        self._pending: dict[str, UsageRecord] = {}
        self._closed = threading.Event()
        self._flush_interval_s = flush_interval_s
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duospec-ledger-writer")
        self._expired_at = -float("inf")  # monotonic time of the last retention pass
        self._flusher = threading.Thread(target=self._flush_loop, name="duospec-ledger", daemon=True)
        self._flusher.start()

    def _migrate(self) -> None:
        """Ledgers written before rows had a server-made id: add the column (old rows keep NULL)."""
        columns = {row[1] for row in self._conn.execute("PRAGMA table_info(usage)")}
        if "id" not in columns:
            self._conn.execute("ALTER TABLE usage ADD COLUMN id TEXT")
        self._conn.execute("CREATE UNIQUE INDEX IF NOT EXISTS usage_id ON usage (id)")

    def start(self, rec: UsageRecord) -> None:
        """The request was admitted: its row exists (durable) before the first token goes out. A row
        with this id already there (a resumed stream's) is taken over if it is the same tenant's."""
        with self._lock:
            if self._conn.execute(_START, astuple(rec)).rowcount == 0:
                raise ValueError(f"row {rec.id} exists under another tenant; it was left as it is")

    def progress(self, rec: UsageRecord) -> None:
        """The latest state of a running request; written by the flusher within flush_interval_s.
        Called on the event loop: it only takes the pending lock, never the connection's."""
        with self._pending_lock:
            self._pending[rec.id] = rec

    def finish(self, rec: UsageRecord) -> None:
        """The final row, durable when this returns (inserted if `start` never ran for it)."""
        with self._pending_lock:
            self._pending.pop(rec.id, None)
        with self._lock:
            if self._conn.execute(_UPDATE, _update_args(rec)).rowcount == 0:
                self._conn.execute(_INSERT, astuple(rec))

    # Off the event loop (an fsync must not stall every other stream), on the ledger's own thread. They
    # never raise: a lost row is logged and counted, and the request goes on.
    async def start_async(self, rec: UsageRecord) -> None:
        await self._write_async("start", self.start, rec)

    async def finish_async(self, rec: UsageRecord) -> None:
        await self._write_async("finish", self.finish, rec)

    async def _write_async(self, operation: str, write: Callable[[UsageRecord], None], rec: UsageRecord) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(self._writer, write, rec)
        except Exception as exc:
            self._failed(operation, exc, rec.id)

    def _failed(self, operation: str, exc: Exception, row: str | None = None) -> None:
        which = f" of row {row}" if row else ""
        log.error("usage ledger %s: the %s write%s failed (%s: %s); usage is missing until a write succeeds",
                  self.path, operation, which, type(exc).__name__, exc)
        if self.on_failure is not None:
            self.on_failure(operation)

    def flush(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        if pending:
            with self._lock, self._conn:  # one transaction, one fsync
                self._conn.execute("BEGIN")
                self._conn.executemany(_PROGRESS, [_update_args(r) for r in pending.values()])

    def expire(self, now: float | None = None) -> int:
        """Deletes the rows finished more than retention_days before `now` (unix seconds); returns how
        many. Batch by batch, so the writer never waits behind one long transaction."""
        if self.retention_days is None:
            return 0
        cutoff = (time.time() if now is None else now) - self.retention_days * 86400.0
        deleted = 0
        while True:
            with self._lock:
                n = self._conn.execute(_EXPIRE, (cutoff,)).rowcount
            deleted += n
            if n < _RETENTION_BATCH:
                break
        return deleted

    def _flush_loop(self) -> None:
        while not self._closed.wait(self._flush_interval_s):
            try:  # a full disk or a locked file: keep the server up, retry next tick
                self.flush()
            except sqlite3.Error as exc:
                self._failed("progress", exc)
            if time.monotonic() - self._expired_at >= RETENTION_INTERVAL_S:
                self._expired_at = time.monotonic()
                try:
                    self.expire()
                except sqlite3.Error as exc:
                    self._failed("retention", exc)

    def close(self) -> None:
        self._closed.set()
        self._flusher.join(timeout=5)
        self._writer.shutdown(wait=True)
        self.flush()
        with self._lock:
            self._conn.close()


def _update_args(rec: UsageRecord) -> tuple:
    return tuple(getattr(rec, c) for c in _UPDATED) + (rec.id, rec.tenant)


def query_usage(path: str | pathlib.Path, tenant: str | None = None, since: float | None = None) -> list[UsageRecord]:
    """Rows ordered by finish time; opened read-only so it works beside a running server."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no usage ledger there; pass --ledger with the server's ledger path")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        columns = {row[1] for row in conn.execute("PRAGMA table_info(usage)")}
        select = ", ".join(c if c in columns else f"NULL AS {c}" for c in _COLUMNS)  # an unmigrated ledger
        sql, params = f"SELECT {select} FROM usage WHERE 1=1", []
        if tenant is not None:
            sql += " AND tenant = ?"
            params.append(tenant)
        if since is not None:
            sql += " AND finished_at >= ?"
            params.append(since)
        rows = conn.execute(sql + " ORDER BY finished_at", params).fetchall()
    finally:
        conn.close()
    return [UsageRecord(*row) for row in rows]


def summarize(records: list[UsageRecord]) -> list[dict]:
    """Per (tenant, model) totals, for the `duospec usage` table. Running requests count with the
    tokens delivered so far; they are not errors."""
    totals: dict[tuple[str, str], dict] = {}
    for r in records:
        t = totals.setdefault(
            (r.tenant, r.model),
            {"tenant": r.tenant, "model": r.model, "requests": 0, "running": 0, "errors": 0, "prompt_tokens": 0,
             "completion_tokens": 0, "drafted": 0, "accepted": 0, "target_forwards": 0},
        )
        t["requests"] += 1
        t["running"] += r.status_code == RUNNING
        t["errors"] += r.status_code not in ("OK", RUNNING)
        for key in ("prompt_tokens", "completion_tokens", "drafted", "accepted", "target_forwards"):
            t[key] += getattr(r, key)
    for t in totals.values():
        t["acceptance"] = t["accepted"] / t["drafted"] if t["drafted"] else 0.0
        t["mean_accepted_length"] = (
            (t["accepted"] + t["target_forwards"]) / t["target_forwards"] if t["target_forwards"] else 0.0
        )
    return sorted(totals.values(), key=lambda t: (t["tenant"], t["model"]))
