"""The PostgreSQL database that gateways share: connections, the schema and its migrations.

One `Database` per gateway: a psycopg 3 connection pool, opened by `connect()`, which first checks the
server answers (a clear error naming the URL, password masked, when it does not) and brings the schema
up to date. The ledger (ledger_postgres.py) and the shared quotas (quota_postgres.py) use it.

Migrations: numbered, each applied once in one transaction and recorded in `schema_migrations`; the
whole run holds a transaction-level advisory lock, so gateways starting together apply each exactly
once (the others wait, then find nothing left to do). A migration is never edited once shipped: a
change is a new one.

A lost database must not slow every request down: after a connection failure, `transaction()` fails at
once for `RETRY_S`, then lets one caller try again (the others keep failing fast meanwhile).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from typing import Iterator
from urllib.parse import urlsplit

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from duospec.coordinator.tenants.ledger import LedgerUnavailable

RETRY_S = 5.0  # after a connection failure: how long calls fail at once before one tries again
CONNECT_TIMEOUT_S = 5
POOL_SIZE = 8  # the ledger's writer and flusher, and the quota store's threads
_MIGRATION_LOCK = 0x64756F73  # pg_advisory_xact_lock key: "duos"
# libpq's knobs for a dead peer: a connection attempt, and an unanswered write, give up after seconds
_CONNECT_ARGS = {"connect_timeout": CONNECT_TIMEOUT_S, "tcp_user_timeout": 10_000, "application_name": "duospec"}

MIGRATIONS: list[tuple[int, str]] = [
    (1, """
        CREATE TABLE usage (                                       -- columns as in ledger_sqlite.py
            id                   text PRIMARY KEY,                 -- server-made; start() upserts on it
            request_id           text NOT NULL,
            tenant               text NOT NULL,
            model                text NOT NULL,
            prompt_tokens        bigint NOT NULL,
            completion_tokens    bigint NOT NULL,
            drafted              bigint NOT NULL,
            accepted             bigint NOT NULL,
            target_forwards      bigint NOT NULL,
            mean_accepted_length double precision NOT NULL,
            finish_reason        text NOT NULL,
            status_code          text NOT NULL,
            started_at           double precision NOT NULL,        -- unix seconds
            finished_at          double precision NOT NULL,
            owner                text                              -- the ledger writer (gateway) that wrote it
        );
        CREATE INDEX usage_tenant_time ON usage (tenant, finished_at);
        CREATE INDEX usage_finished ON usage (finished_at);
        CREATE INDEX usage_running ON usage (owner) WHERE status_code = 'RUNNING';
        CREATE TABLE ledger_writers (
            owner        text PRIMARY KEY,
            started_at   double precision NOT NULL,                -- the database's clock, unix seconds
            heartbeat_at double precision NOT NULL
        );
    """),
    (2, """
        -- Shared budgets (quota_postgres.py): a token bucket per tenant and limit, and a lease per open stream.
        CREATE TABLE tenant_budget (
            tenant      text NOT NULL,
            bucket      text NOT NULL,                             -- requests | tokens
            level       double precision NOT NULL,
            refilled_at double precision NOT NULL,                 -- the database's clock, unix seconds
            PRIMARY KEY (tenant, bucket)
        );
        CREATE TABLE stream_leases (
            id        text PRIMARY KEY,
            tenant    text NOT NULL,
            owner     text NOT NULL,                               -- a ledger_writers owner: leases die with it
            opened_at double precision NOT NULL
        );
        CREATE INDEX stream_leases_tenant ON stream_leases (tenant);

        -- Takes p_amount and returns 0, or takes nothing and returns the seconds until it would fit
        -- ('Infinity': never). A bucket starts full; it refills at p_rate a second up to p_cap, the
        -- caller's limit (after a limit change the level carries over, clamped to the new capacity).
        CREATE FUNCTION duospec_bucket_take(p_tenant text, p_bucket text, p_amount float8, p_cap float8,
                                            p_rate float8) RETURNS float8 LANGUAGE plpgsql AS $$
        DECLARE
            now_s float8;
            avail float8;
        BEGIN
            PERFORM 1 FROM tenant_budget WHERE tenant = p_tenant AND bucket = p_bucket FOR UPDATE;
            IF NOT FOUND THEN
                INSERT INTO tenant_budget VALUES (p_tenant, p_bucket, p_cap, extract(epoch FROM clock_timestamp()))
                    ON CONFLICT DO NOTHING;
                PERFORM 1 FROM tenant_budget WHERE tenant = p_tenant AND bucket = p_bucket FOR UPDATE;
            END IF;
            now_s := extract(epoch FROM clock_timestamp());  -- read under the row lock: refills never overlap
            SELECT least(p_cap, level + greatest(0, now_s - refilled_at) * p_rate) INTO avail
                FROM tenant_budget WHERE tenant = p_tenant AND bucket = p_bucket;
            IF p_amount > avail THEN
                RETURN CASE WHEN p_amount > p_cap THEN 'Infinity'::float8 ELSE (p_amount - avail) / p_rate END;
            END IF;
            UPDATE tenant_budget SET level = avail - p_amount, refilled_at = now_s
                WHERE tenant = p_tenant AND bucket = p_bucket;
            RETURN 0;
        END $$;

        CREATE FUNCTION duospec_bucket_give(p_tenant text, p_bucket text, p_amount float8, p_cap float8,
                                            p_rate float8) RETURNS void LANGUAGE plpgsql AS $$
        DECLARE
            now_s float8 := extract(epoch FROM clock_timestamp());
        BEGIN
            UPDATE tenant_budget
                SET level = least(p_cap, level + greatest(0, now_s - refilled_at) * p_rate + p_amount),
                    refilled_at = greatest(refilled_at, now_s)
                WHERE tenant = p_tenant AND bucket = p_bucket;
        END $$;

        -- A stream (when p_max_streams is set) and p_tokens from tokens/min (when p_cap is set), or neither:
        -- returns (NULL, 0) when taken, else the limit that refused and its value (open streams, or
        -- seconds until the tokens fit). Leases of writers silent for p_stale_s are dropped first.
        CREATE FUNCTION duospec_reserve(p_tenant text, p_lease text, p_owner text, p_max_streams int,
                                        p_stale_s float8, p_tokens float8, p_cap float8, p_rate float8)
            RETURNS TABLE (refused text, value float8) LANGUAGE plpgsql AS $$
        DECLARE
            n int;
            wait float8;
        BEGIN
            IF p_max_streams IS NOT NULL THEN
                -- one reservation of this tenant at a time, so the count stays true until the insert commits
                PERFORM pg_advisory_xact_lock(hashtext('duospec.streams'), hashtext(p_tenant));
                DELETE FROM stream_leases l WHERE l.tenant = p_tenant AND NOT EXISTS (
                    SELECT 1 FROM ledger_writers w WHERE w.owner = l.owner
                    AND w.heartbeat_at >= extract(epoch FROM clock_timestamp()) - p_stale_s);
                SELECT count(*) INTO n FROM stream_leases WHERE tenant = p_tenant;
                IF n >= p_max_streams THEN
                    RETURN QUERY SELECT 'max_concurrent_streams'::text, n::float8;
                    RETURN;
                END IF;
            END IF;
            IF p_cap IS NOT NULL THEN
                wait := duospec_bucket_take(p_tenant, 'tokens', p_tokens, p_cap, p_rate);
                IF wait > 0 THEN
                    RETURN QUERY SELECT 'tokens_per_minute'::text, wait;
                    RETURN;
                END IF;
            END IF;
            IF p_max_streams IS NOT NULL THEN
                INSERT INTO stream_leases VALUES (p_lease, p_tenant, p_owner, extract(epoch FROM clock_timestamp()));
            END IF;
            RETURN QUERY SELECT NULL::text, 0::float8;
        END $$;
    """),
]


def mask_url(url: str) -> str:
    """The URL with its password replaced by ***, for every message and log line."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return re.sub(r"(//[^:/@]*:)[^@]*@", r"\1***@", url, count=1)


def describe(exc: BaseException, url: str) -> str:
    """An error's message on one line, without the password should a driver ever echo it."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    password = urlsplit(url).password
    return text.replace(password, "***") if password else text


class DatabaseDown(psycopg.OperationalError):
    """A recent connection failure: not tried again until RETRY_S has passed."""


class Database:
    def __init__(self, url: str, pool: ConnectionPool):
        self.url = url
        self.name = mask_url(url)
        self.pool = pool
        self._lock = threading.Lock()
        self._down_until: float | None = None  # monotonic; None while the database answers
        self._down_reason = ""

    @contextlib.contextmanager
    def transaction(self) -> Iterator[psycopg.Cursor]:
        """A cursor in one transaction (committed on exit); fails fast while the database is down."""
        self._admit_attempt()
        try:
            with self.pool.connection() as conn:
                try:
                    with conn.transaction(), conn.cursor() as cur:
                        yield cur
                except psycopg.OperationalError as exc:
                    if conn.broken or conn.closed:  # the server is gone (not a deadlock or a cancel)
                        self._down(exc)
                    raise
        except PoolTimeout as exc:  # no connection could be made
            self._down(exc)
            raise
        with self._lock:
            self._down_until = None

    def _down(self, exc: BaseException) -> None:
        with self._lock:
            self._down_until, self._down_reason = time.monotonic() + RETRY_S, describe(exc, self.url)

    def _admit_attempt(self) -> None:
        with self._lock:
            if self._down_until is None:
                return
            if time.monotonic() < self._down_until:
                raise DatabaseDown(f"{self.name} unreachable ({self._down_reason}); retrying within {RETRY_S:g} s")
            self._down_until = time.monotonic() + RETRY_S  # this caller tries; the others still fail fast

    def close(self) -> None:
        self.pool.close()


def connect(url: str) -> Database:
    """Checks the server answers, migrates the schema, opens the pool. Raises LedgerUnavailable."""
    name = mask_url(url)
    try:
        with psycopg.connect(url, **_CONNECT_ARGS) as conn:
            migrate(conn)
    except psycopg.Error as exc:
        raise LedgerUnavailable(f"ledger {name}: {describe(exc, url)}; check the URL, that the database "
                                "server is up and reachable, and the user's password and rights") from None
    pool = ConnectionPool(url, kwargs=_CONNECT_ARGS, min_size=1, max_size=POOL_SIZE, timeout=2.0,
                          open=False, name="duospec-ledger", reconnect_timeout=float("inf"))
    try:
        pool.open(wait=True, timeout=CONNECT_TIMEOUT_S * 2)
    except PoolTimeout as exc:
        pool.close()
        raise LedgerUnavailable(f"ledger {name}: {describe(exc, url)}") from None
    return Database(url, pool)


def migrate(conn: psycopg.Connection) -> list[int]:
    """Applies the migrations not yet recorded; returns their versions. Safe from many gateways at once."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version integer PRIMARY KEY, "
                     "applied_at timestamptz NOT NULL DEFAULT now())")
        done = {row[0] for row in conn.execute("SELECT version FROM schema_migrations")}
        applied = []
        for version, sql in MIGRATIONS:
            if version not in done:
                conn.execute(sql)
                conn.execute("INSERT INTO schema_migrations (version) VALUES (%s)", (version,))
                applied.append(version)
    return applied
