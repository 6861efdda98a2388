"""Tenant budgets shared by every gateway, in the PostgreSQL ledger's database (quota.py's interface).

Why this shape:
  - A token bucket is a row (`tenant_budget`: level, refilled_at), taken from by one function call
    (`duospec_bucket_take`, postgres.py) that locks the row, refills it for the time since the last
    take with the database's clock (so gateways' clocks never matter) and takes all or nothing. Every
    gateway takes from the same row: a tenant's requests/min and tokens/min hold across all of them
    together, to the request — not N times the limit, and not per refill interval. Refunds
    (`duospec_bucket_give`) are the same under the lock.
  - A concurrent stream is a lease row (tenant, lease id, owner) inserted at admission and deleted at
    release. Counting and inserting happen under a per-tenant advisory lock, together with the tokens
    (`duospec_reserve`: both or neither). A lease belongs to its gateway's ledger writer: when that
    gateway stops heartbeating for STALE_AFTER_S (it crashed), its leases stop counting.
  - One round trip per check, on this store's threads (never the event loop); a tenant with no limit
    of a kind costs no round trip for it.

Failure policy: fail open. A quota check that cannot reach the database (or errs) never fails the
request: it is decided by this gateway's own in-process budgets instead (`LocalQuotas`: the same
limits, per gateway, so a tenant gets at most N gateways' worth while the database is away, never
unlimited), counted in `duospec:quota_store_failures{operation}` and logged (at most every
LOG_EVERY_S). A service that stays up matters more to its users than a quota held exactly during an
outage; the metric is what an operator alerts on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
import uuid
from typing import Any, Callable, Iterable

import psycopg
from psycopg_pool import PoolTimeout

from duospec.coordinator.tenants.postgres import Database, describe
from duospec.coordinator.tenants.quota import Lease, LocalQuotas, Refused
from duospec.coordinator.tenants.tenancy import Tenant

log = logging.getLogger("duospec.quotas")

LOG_EVERY_S = 30.0
_ERRORS = (psycopg.Error, PoolTimeout)


class PostgresQuotas:
    """`owner`: the gateway's ledger writer (its heartbeat keeps this gateway's leases alive)."""

    def __init__(self, database: Database, owner: str, *, stale_after_s: float,
                 on_failure: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 threads: int = 4):
        self.database = database
        self.owner = owner
        self.stale_after_s = stale_after_s
        self.on_failure = on_failure
        self._fallback = LocalQuotas(clock)  # tenants without shared limits, and the database's outages
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="duospec-quotas")
        self._logged_at = -math.inf
        self._releases: set[concurrent.futures.Future] = set()  # written off the event loop, not yet done

    def set_tenants(self, tenants: Iterable[Tenant]) -> None:
        self._fallback.set_tenants(tenants)  # (shared buckets take the caller's limits at each take)

    async def charge_request(self, tenant: Tenant) -> float:
        per_minute = tenant.limits.requests_per_minute
        if not per_minute:
            return 0.0
        try:
            return await self._run(self._take_request, tenant.name, per_minute)
        except _ERRORS as exc:
            self._failed("charge_request", exc)
            return self._fallback.charge(tenant)

    async def reserve(self, tenant: Tenant, tokens: int) -> Lease | Refused:
        limits = tenant.limits
        if not limits.max_concurrent_streams and not limits.tokens_per_minute:
            return self._fallback.take(tenant, tokens)  # nothing to share: no round trip
        lease = Lease(uuid.uuid4().hex, tokens, shared=True)
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._reserve, tenant, lease)
        try:
            refused, value = await asyncio.shield(future)
        except asyncio.CancelledError:  # the caller left; what the thread took goes back once it has
            future.add_done_callback(lambda f: self._release_if_taken(f, tenant, lease))
            raise
        except _ERRORS as exc:
            self._failed("reserve", exc)
            return self._fallback.take(tenant, tokens)
        return Refused(refused, value) if refused else lease

    def release(self, tenant: Tenant, lease: Lease, unused_tokens: int) -> None:
        if not lease.shared:
            self._fallback.release(tenant, lease, unused_tokens)
            return
        future = self._executor.submit(self._release_guarded, tenant, lease, unused_tokens)
        self._releases.add(future)
        future.add_done_callback(self._releases.discard)

    def wait_released(self, timeout_s: float | None = None) -> None:
        """Returns once the releases asked for so far are written (or have failed)."""
        concurrent.futures.wait(list(self._releases), timeout_s)

    def close(self) -> None:
        self._executor.shutdown(wait=True)  # the releases still queued are written first

    # ---- on this store's threads -----------------------------------------------------------------------

    def _take_request(self, tenant_name: str, per_minute: int) -> float:
        with self.database.transaction() as cur:
            cur.execute("SELECT duospec_bucket_take(%s, 'requests', 1, %s, %s)",
                        (tenant_name, per_minute, per_minute / 60.0))
            return cur.fetchone()[0]

    def _reserve(self, tenant: Tenant, lease: Lease) -> tuple[str | None, float]:
        limits = tenant.limits
        tpm = limits.tokens_per_minute
        with self.database.transaction() as cur:
            cur.execute("SELECT * FROM duospec_reserve(%s, %s, %s, %s, %s, %s, %s, %s)",
                        (tenant.name, lease.id, self.owner, limits.max_concurrent_streams, self.stale_after_s,
                         lease.tokens, tpm, tpm / 60.0 if tpm else None))
            return cur.fetchone()

    def _release_guarded(self, tenant: Tenant, lease: Lease, unused_tokens: int) -> None:
        try:
            tpm = tenant.limits.tokens_per_minute
            with self.database.transaction() as cur:
                cur.execute("DELETE FROM stream_leases WHERE id = %s", (lease.id,))
                if tpm and unused_tokens > 0:
                    cur.execute("SELECT duospec_bucket_give(%s, 'tokens', %s, %s, %s)",
                                (tenant.name, unused_tokens, tpm, tpm / 60.0))
        except _ERRORS as exc:  # the lease ends with this gateway's heartbeat; the refund is lost
            self._failed("release", exc)

    def _release_if_taken(self, future: asyncio.Future, tenant: Tenant, lease: Lease) -> None:
        if not future.cancelled() and future.exception() is None and future.result()[0] is None:
            self.release(tenant, lease, lease.tokens)

    async def _run(self, work: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, work, *args)

    def _failed(self, operation: str, exc: BaseException) -> None:
        if self.on_failure is not None:
            self.on_failure(operation)
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            log.error("shared quotas in %s: %s failed (%s: %s); admitting on this gateway's own budgets until "
                      "the database answers (counted in duospec:quota_store_failures; logged at most every "
                      "%g s)", self.database.name, operation, type(exc).__name__, describe(exc, self.database.url),
                      LOG_EVERY_S)
