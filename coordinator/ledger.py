"""Usage ledger: one SQLite row per finished request, committed as the request finishes.

WAL mode with synchronous=FULL: each commit is on disk before `record` returns, so a `kill -9` of the
server (or a power cut) loses no finished request. Readers (`duospec usage`) never block the writer.
"""

from __future__ import annotations

import asyncio
import pathlib
import sqlite3
import threading
from dataclasses import astuple, dataclass, fields

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    request_id           TEXT NOT NULL,
    tenant               TEXT NOT NULL,
    model                TEXT NOT NULL,
    prompt_tokens        INTEGER NOT NULL,
    completion_tokens    INTEGER NOT NULL,
    drafted              INTEGER NOT NULL,
    accepted             INTEGER NOT NULL,
    target_forwards      INTEGER NOT NULL,
    mean_accepted_length REAL NOT NULL,
    finish_reason        TEXT NOT NULL,   -- length|stop|eos|cancelled, or the gRPC status name on error
    status_code          TEXT NOT NULL,   -- OK or the gRPC status name
    started_at           REAL NOT NULL,   -- unix seconds
    finished_at          REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_tenant_time ON usage (tenant, finished_at);
"""


@dataclass(frozen=True)
class UsageRecord:
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


class UsageLedger:
    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute("PRAGMA busy_timeout=5000")
        self._conn.executescript(_SCHEMA)

    def record(self, rec: UsageRecord) -> None:
        sql = f"INSERT INTO usage ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
        with self._lock:
            self._conn.execute(sql, astuple(rec))  # autocommit: durable when this returns

    async def record_async(self, rec: UsageRecord) -> None:
        """Writes off the event loop: an fsync must not stall every other stream."""
        await asyncio.to_thread(self.record, rec)

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def query_usage(path: str | pathlib.Path, tenant: str | None = None, since: float | None = None) -> list[UsageRecord]:
    """Rows ordered by finish time; opened read-only so it works beside a running server."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no usage ledger there; pass --ledger with the server's ledger path")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        sql, params = f"SELECT {', '.join(_COLUMNS)} FROM usage WHERE 1=1", []
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
    """Per (tenant, model) totals, for the `duospec usage` table."""
    totals: dict[tuple[str, str], dict] = {}
    for r in records:
        t = totals.setdefault(
            (r.tenant, r.model),
            {"tenant": r.tenant, "model": r.model, "requests": 0, "errors": 0, "prompt_tokens": 0,
             "completion_tokens": 0, "drafted": 0, "accepted": 0, "target_forwards": 0},
        )
        t["requests"] += 1
        t["errors"] += r.status_code != "OK"
        for key in ("prompt_tokens", "completion_tokens", "drafted", "accepted", "target_forwards"):
            t[key] += getattr(r, key)
    for t in totals.values():
        t["acceptance"] = t["accepted"] / t["drafted"] if t["drafted"] else 0.0
        t["mean_accepted_length"] = (
            (t["accepted"] + t["target_forwards"]) / t["target_forwards"] if t["target_forwards"] else 0.0
        )
    return sorted(totals.values(), key=lambda t: (t["tenant"], t["model"]))
