"""Usage ledger: one row per request, written when it is admitted and kept current while it streams.

Two backends behind one class (`open_ledger` picks by the location): SQLite (a file path; embedded,
the default for one gateway — ledger_sqlite.py) and PostgreSQL (a `postgresql://` URL; shared by any
number of gateways — ledger_postgres.py). Everything below is common to both: the backends only open
connections, run their migrations and name their clock.

A row's life: `start()` writes it as the request is admitted (status RUNNING), `progress()` notes the
tokens delivered so far, and a flusher thread writes every stream's latest progress in one
transaction each `flush_interval_s` (1 s): one commit per second for the whole gateway, however many
streams are open. `finish()` writes the final row at once. What a write committed is durable (SQLite:
WAL with synchronous=FULL; PostgreSQL: its commit), so a `kill -9` of the gateway loses at most the
last second of a stream's usage and never a row.

Rows are keyed by a server-made `id`, unique (a unique index in both backends); the client's request
id is kept as `request_id` (clients may reuse theirs). `start()` is an upsert on `id`: when the row
exists and belongs to the same tenant, it is taken over — RUNNING again, owned by this writer, with the
record's counts (completion_tokens never lowered), keeping its `started_at` and `request_id` — and
`start()` returns the row as stored, so a resumed stream (the same server-made id, sent back by its
client) continues its original row instead of being charged twice; the caller passes cumulative counts
from then on. A row of another tenant is
never touched: `start()` raises `UsageRowTaken`.

Writers and crashes: each ledger writer has an `owner` id (host, process id and start time), stamps
the rows it writes with it, and registers in `ledger_writers`. A RUNNING row whose owner is gone was
cut off by a crash: it is closed as finish_reason `interrupted`, status UNAVAILABLE, keeping the
tokens it had delivered. Other gateways' rows are live (PostgreSQL; or the gateways of one node
sharing a SQLite file), so "gone" means no heartbeat — the flusher stamps
`ledger_writers.heartbeat_at` each flush, with the database's clock — for `STALE_AFTER_S` (30 s), or
a writer that closed cleanly (it unregisters): checked at open and every `STALE_AFTER_S`. Progress and
finish only write rows their writer owns: after a resumed stream moved to another gateway, the old
gateway's late writes cannot overwrite it.

Writes run on the ledger's own thread (`start_async`, `finish_async`), never on the executor that
tokenizes prompts: a slow disk or database delays usage rows, not requests. Rows finished more than
`retention_days` ago are deleted once an hour, in small batches. A failed write never fails a request:
it is logged and reported to `on_failure(operation)` (the server counts it in
`duospec:ledger_write_failures`), so an operator can alert on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple, dataclass, fields
from typing import Any, Callable, ClassVar

log = logging.getLogger("duospec.ledger")

RUNNING = "RUNNING"  # status_code of a row whose request is still streaming
FLUSH_INTERVAL_S = 1.0
STALE_AFTER_S = 30.0  # a writer silent this long is gone: its RUNNING rows (and quota leases) are closed
RETENTION_INTERVAL_S = 3600.0  # how often rows past the retention are deleted
_RETENTION_BATCH = 5000  # rows per delete: a short transaction, so writes in between never wait long
_WRITERS_KEPT_S = 86400.0  # rows of writers silent this long leave ledger_writers at the retention pass


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


class LedgerUnavailable(OSError):
    """The ledger could not be opened; the message names it (a URL's password masked) and the cause."""


class UsageRowTaken(ValueError):
    """`start()` named the id of another tenant's row; the row is left as it was."""


COLUMNS = [f.name for f in fields(UsageRecord)]
# A row's identity and start are written once, at insert; a resumed stream's later records keep them.
_LIVE = [c for c in COLUMNS if c not in ("id", "request_id", "tenant", "started_at")]
_INSERT = f"INSERT INTO usage ({', '.join(COLUMNS)}, owner) VALUES ({', '.join('?' * (len(COLUMNS) + 1))})"


def select_usage(tenant: str | None, since: float | None, columns: list[str] = COLUMNS) -> tuple[str, list]:
    """The read `duospec usage` makes, in either backend (`?` placeholders)."""
    sql, params = f"SELECT {', '.join(columns)} FROM usage WHERE 1=1", []
    if tenant is not None:
        sql += " AND tenant = ?"
        params.append(tenant)
    if since is not None:
        sql += " AND finished_at >= ?"
        params.append(since)
    return sql + " ORDER BY finished_at", params


def _statements(now: str, rowkey: str, greatest: str) -> dict[str, str]:
    """The ledger's SQL for a backend: `now` is its clock in unix seconds, `rowkey` its physical row id,
    `greatest` its two-argument max. Both backends speak this dialect (upsert with a WHERE, RETURNING);
    placeholders are `?`. completion_tokens never goes down: a resumed stream is charged for the most
    tokens any of its streams sent."""
    def new_value(column: str, value: str) -> str:
        if column == "completion_tokens":
            return f"{column} = {greatest}(usage.{column}, {value})"
        return f"{column} = {value}"

    set_live = ", ".join(new_value(c, f"excluded.{c}") for c in _LIVE + ["owner"])
    live = f"SELECT owner FROM ledger_writers WHERE heartbeat_at >= {now} - ?"
    return {
        # A takeover only of the same tenant's row (a resumed stream); nothing comes back otherwise.
        "start": f"{_INSERT} ON CONFLICT (id) DO UPDATE SET {set_live} WHERE usage.tenant = excluded.tenant "
                 f"RETURNING {', '.join(COLUMNS)}",
        # The final row, inserted if `start` never ran for it; never over a row another writer took over.
        "finish": f"{_INSERT} ON CONFLICT (id) DO UPDATE SET {set_live} WHERE usage.owner = excluded.owner",
        # Progress never overwrites a finished row (a flush racing the request's end) or another writer's.
        "progress": f"UPDATE usage SET {', '.join(new_value(c, '?') for c in _LIVE)} "
                    f"WHERE id = ? AND owner = ? AND status_code = '{RUNNING}'",
        "heartbeat": f"INSERT INTO ledger_writers (owner, started_at, heartbeat_at) VALUES (?, {now}, {now}) "
                     "ON CONFLICT (owner) DO UPDATE SET heartbeat_at = excluded.heartbeat_at",
        "interrupt": f"UPDATE usage SET finish_reason = 'interrupted', status_code = 'UNAVAILABLE' "
                     f"WHERE status_code = '{RUNNING}' AND (owner IS NULL OR (owner <> ? AND owner NOT IN ({live})))",
        "expire": f"DELETE FROM usage WHERE {rowkey} IN (SELECT {rowkey} FROM usage WHERE finished_at < ? "
                  f"AND status_code <> '{RUNNING}' LIMIT {_RETENTION_BATCH})",
        "forget_writers": f"DELETE FROM ledger_writers WHERE heartbeat_at < {now} - ? AND owner <> ?",
        "unregister": "DELETE FROM ledger_writers WHERE owner = ?",
    }


def new_owner() -> str:
    """This writer's id: host, process and start time, so a restarted gateway is a new owner."""
    return f"{socket.gethostname()}/{os.getpid()}@{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.{time.time_ns() % 10**6:06d}"


class UsageLedger:
    """The ledger's behaviour, whatever stores it; subclasses give the connection and the dialect.

    `retention_days`: rows finished longer ago are deleted (None or 0: kept). `on_failure(operation)`:
    told of every failed write ("start", "finish", "progress", "interrupt" or "retention") after it is
    logged."""

    NOW_SQL: ClassVar[str]  # the database's clock, unix seconds
    ROWKEY: ClassVar[str]  # a physical row id, for batched deletes (legacy rows may lack `id`)
    GREATEST_SQL: ClassVar[str]  # the larger of two values
    STALE_AFTER_S: ClassVar[float] = STALE_AFTER_S  # 30 flushes missed: a gateway that is gone, not busy
    ERRORS: ClassVar[tuple[type[Exception], ...]]  # what a failed write raises

    def __init__(self, name: str, flush_interval_s: float, retention_days: float | None,
                 on_failure: Callable[[str], None] | None):
        """Called by a backend once its connection is open and its schema migrated."""
        self.name = name  # for messages: the path, or the URL with its password masked
        self.retention_days = retention_days or None
        self.on_failure = on_failure
        self.owner = new_owner()
        self._sql = {k: self._dialect(v) for k, v in _statements(self.NOW_SQL, self.ROWKEY, self.GREATEST_SQL).items()}
        self._pending_lock = threading.Lock()  # guards _pending only: progress() never waits for a commit
        self._pending: dict[str, UsageRecord] = {}
        try:
            with self._transaction() as tx:
                tx.execute(self._sql["heartbeat"], (self.owner,))
            self.close_interrupted()
        except self.ERRORS as exc:
            self._close_connections()
            raise LedgerUnavailable(f"ledger {name}: {' '.join(str(exc).split())}") from None
        self._closed = threading.Event()
        self._flush_interval_s = flush_interval_s
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duospec-ledger-writer")
        self._expired_at = -float("inf")  # monotonic time of the last retention pass
        self._interrupted_at = time.monotonic()  # ... and of the last close of gone writers' rows
        self._flusher = threading.Thread(target=self._flush_loop, name="duospec-ledger", daemon=True)
        self._flusher.start()

    # ---- what a backend provides -------------------------------------------------------------------

    def _dialect(self, sql: str) -> str:
        """`sql` with the backend's placeholders."""
        return sql

    def _transaction(self) -> contextlib.AbstractContextManager[Any]:
        """One transaction; yields an object with `execute(sql, params)` and `executemany(sql, rows)`
        returning a DB-API cursor. Commits on exit, rolls back on an exception."""
        raise NotImplementedError

    def _close_connections(self) -> None:
        raise NotImplementedError

    def shared_quotas(self, on_failure: Callable[[str], None] | None = None):
        """A QuotaStore (quota.py) every gateway on this ledger shares; None: this process's budgets,
        exact for the one gateway an embedded ledger serves."""
        return None

    # ---- writes ----------------------------------------------------------------------------------------

    def start(self, rec: UsageRecord) -> UsageRecord:
        """The request was admitted: its row exists (durable) before the first token goes out. Returns the
        row as stored (a resumed stream's original row, taken over); raises UsageRowTaken when the id
        is another tenant's."""
        with self._transaction() as tx:
            rows = tx.execute(self._sql["start"], astuple(rec) + (self.owner,)).fetchall()
        if not rows:
            raise UsageRowTaken(f"usage row {rec.id} belongs to another tenant than {rec.tenant!r}; left as it was")
        return UsageRecord(*rows[0])

    def progress(self, rec: UsageRecord) -> None:
        """The latest state of a running request; written by the flusher within flush_interval_s.
        Called on the event loop: it only takes the pending lock, never a connection."""
        with self._pending_lock:
            self._pending[rec.id] = rec

    def finish(self, rec: UsageRecord) -> None:
        """The final row, durable when this returns (inserted if `start` never ran for it)."""
        with self._pending_lock:
            self._pending.pop(rec.id, None)
        with self._transaction() as tx:
            if tx.execute(self._sql["finish"], astuple(rec) + (self.owner,)).rowcount == 0:
                log.info("usage ledger %s: row %s is owned by another writer now (its stream resumed there); "
                         "this writer's final record is dropped", self.name, rec.id)

    # Off the event loop (a commit must not stall every other stream), on the ledger's own thread. They
    # never raise a failed write: it is logged and counted, and the request goes on.
    async def start_async(self, rec: UsageRecord) -> UsageRecord | None:
        """`start` on the ledger's thread; None when the write failed. Raises UsageRowTaken."""
        return await self._write_async("start", self.start, rec)

    async def finish_async(self, rec: UsageRecord) -> None:
        await self._write_async("finish", self.finish, rec)

    async def _write_async(self, operation: str, write: Callable[[UsageRecord], Any], rec: UsageRecord):
        try:
            # Shielded: a stream whose client hung up (its task cancelled) still gets its row written; an
            # unshielded write still queued behind another would be dropped with the task.
            return await asyncio.shield(asyncio.get_running_loop().run_in_executor(self._writer, write, rec))
        except UsageRowTaken:
            raise
        except Exception as exc:
            self._failed(operation, exc, rec.id)
            return None

    def _failed(self, operation: str, exc: Exception, row: str | None = None) -> None:
        which = f" of row {row}" if row else ""
        log.error("usage ledger %s: the %s write%s failed (%s: %s); usage is missing until a write succeeds",
                  self.name, operation, which, type(exc).__name__, str(exc).strip())
        if self.on_failure is not None:
            self.on_failure(operation)

    def flush(self) -> None:
        """Every stream's latest progress, and this writer's heartbeat, in one transaction."""
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        try:
            with self._transaction() as tx:
                if pending:
                    tx.executemany(self._sql["progress"], [tuple(getattr(r, c) for c in _LIVE) + (r.id, self.owner)
                                                           for r in pending.values()])
                tx.execute(self._sql["heartbeat"], (self.owner,))
        except BaseException:
            with self._pending_lock:  # not written: keep what no newer progress replaced, for the next flush
                for key, rec in pending.items():
                    self._pending.setdefault(key, rec)
            raise

    def close_interrupted(self) -> int:
        """Closes the RUNNING rows of writers that are gone (crashed) as interrupted; returns how many."""
        with self._transaction() as tx:
            n = tx.execute(self._sql["interrupt"], (self.owner, self.STALE_AFTER_S)).rowcount
        if n:
            log.warning("usage ledger %s: closed %d rows of gateways that stopped without finishing them "
                        "as interrupted", self.name, n)
        return n

    def expire(self, now: float | None = None) -> int:
        """Deletes the rows finished more than retention_days before `now` (unix seconds); returns how
        many. Batch by batch, so the writer never waits behind one long transaction."""
        with self._transaction() as tx:
            tx.execute(self._sql["forget_writers"], (_WRITERS_KEPT_S, self.owner))
        if self.retention_days is None:
            return 0
        cutoff = (time.time() if now is None else now) - self.retention_days * 86400.0
        deleted = 0
        while True:
            with self._transaction() as tx:
                n = tx.execute(self._sql["expire"], (cutoff,)).rowcount
            deleted += n
            if n < _RETENTION_BATCH:
                break
        return deleted

    def _flush_loop(self) -> None:
        while not self._closed.wait(self._flush_interval_s):
            # A full disk, a locked file, a lost database: keep the server up, retry next tick.
            self._guarded("progress", self.flush)
            if time.monotonic() - self._interrupted_at >= self.STALE_AFTER_S:
                self._interrupted_at = time.monotonic()
                self._guarded("interrupt", self.close_interrupted)
            if time.monotonic() - self._expired_at >= RETENTION_INTERVAL_S:
                self._expired_at = time.monotonic()
                self._guarded("retention", self.expire)

    def _guarded(self, operation: str, work: Callable[[], Any]) -> None:
        try:
            work()
        except self.ERRORS as exc:
            self._failed(operation, exc)

    def close(self) -> None:
        self._closed.set()
        self._flusher.join(timeout=5)
        self._writer.shutdown(wait=True)
        self._guarded("progress", self.flush)
        # Gone cleanly: another writer may close whatever this one left RUNNING, without waiting.
        self._guarded("unregister", lambda: self._execute("unregister", (self.owner,)))
        self._close_connections()

    def _execute(self, statement: str, params: tuple) -> None:
        with self._transaction() as tx:
            tx.execute(self._sql[statement], params)


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
