"""Tenant budgets: requests/min, tokens/min and concurrent streams, behind one interface Admission calls.

Two stores: `LocalQuotas` (this process's token buckets and stream counts: one gateway, or SQLite) and
`PostgresQuotas` (quota_postgres.py: the same budgets in the PostgreSQL ledger's database, shared by
every gateway). Admission asks a store three things, in its order: charge one request
(`charge_request`), reserve a stream and the request's tokens together (`reserve`: both or neither),
and give them back (`release`: the stream, and the tokens the request did not use). What is per
gateway — the weighted queue and the generation slots — stays in Admission.

Bucket semantics (both stores): a bucket holds up to `per_minute` units and refills continuously at
per_minute / 60 a second; a take that fits is taken whole, one that does not takes nothing and is told
the seconds until it would fit (infinite when it exceeds the capacity).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from duospec.coordinator.tenants.tenancy import Tenant, TenantLimits


@dataclass(frozen=True)
class Lease:
    """What `reserve` took, to hand back to `release` exactly once."""

    id: str  # unique per reservation (the shared store's lease row)
    tokens: int  # taken from tokens/min
    shared: bool = False  # held in the shared store; False: in this process's (LocalQuotas, or a fallback)


@dataclass(frozen=True)
class Refused:
    """Why `reserve` took nothing: `limit` is the tenant's limit that refused, `value` the open streams
    (max_concurrent_streams) or the seconds until the tokens fit (tokens_per_minute; inf: never)."""

    limit: str
    value: float


class QuotaStore(Protocol):
    async def charge_request(self, tenant: Tenant) -> float:
        """Takes one request from requests/min: 0.0, or (nothing taken) the seconds until it would fit."""

    async def reserve(self, tenant: Tenant, tokens: int) -> Lease | Refused:
        """A stream (if the tenant has max_concurrent_streams) and `tokens` from tokens/min, or neither."""

    def release(self, tenant: Tenant, lease: Lease, unused_tokens: int) -> None:
        """Closes the lease's stream and refunds `unused_tokens` (never waits: called as a stream ends)."""

    def set_tenants(self, tenants: Iterable[Tenant]) -> None:
        """The tenants file (again after a reload): changed limits apply from now."""

    def close(self) -> None: ...


class TokenBucket:
    """Holds up to `per_minute` units, refilled continuously at per_minute / 60 per second."""

    def __init__(self, per_minute: int, clock: Callable[[], float]):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self._clock = clock
        self._last = clock()

    def _refill(self) -> None:
        now = self._clock()
        self.level = min(self.capacity, self.level + (now - self._last) * self.rate)
        self._last = now

    def try_take(self, amount: float) -> float:
        """Takes `amount` and returns 0.0, or takes nothing and returns seconds until it would fit."""
        self._refill()
        if amount <= self.level:
            self.level -= amount
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self.level) / self.rate

    def give_back(self, amount: float) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + amount)


class _TenantBudget:
    def __init__(self, limits: TenantLimits, clock: Callable[[], float]):
        self.streams = 0  # running + waiting for a slot
        self.set_limits(limits, clock)

    def set_limits(self, limits: TenantLimits, clock: Callable[[], float]) -> None:
        """New buckets, full, for new limits (a tenants-file reload); the stream count carries over."""
        self.limits = limits
        self.requests = TokenBucket(limits.requests_per_minute, clock) if limits.requests_per_minute else None
        self.tokens = TokenBucket(limits.tokens_per_minute, clock) if limits.tokens_per_minute else None


class LocalQuotas:
    """The budgets in this process: exact for one gateway. Its coroutines never wait, so a check and
    its take happen with nothing in between."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._budgets: dict[str, _TenantBudget] = {}
        self._ids = itertools.count()

    def _budget(self, tenant: Tenant) -> _TenantBudget:
        budget = self._budgets.get(tenant.name)
        if budget is None:
            budget = self._budgets[tenant.name] = _TenantBudget(tenant.limits, self._clock)
        return budget

    def set_tenants(self, tenants: Iterable[Tenant]) -> None:
        for t in tenants:
            budget = self._budgets.get(t.name)
            if budget is not None and budget.limits != t.limits:
                budget.set_limits(t.limits, self._clock)

    def charge(self, tenant: Tenant) -> float:
        budget = self._budget(tenant)
        return budget.requests.try_take(1) if budget.requests is not None else 0.0

    def take(self, tenant: Tenant, tokens: int) -> Lease | Refused:
        budget, limit = self._budget(tenant), tenant.limits.max_concurrent_streams
        if limit and budget.streams >= limit:
            return Refused("max_concurrent_streams", budget.streams)
        if budget.tokens is not None:
            wait = budget.tokens.try_take(tokens)
            if wait:
                return Refused("tokens_per_minute", wait)
        budget.streams += 1
        return Lease(f"local-{next(self._ids)}", tokens)

    async def charge_request(self, tenant: Tenant) -> float:
        return self.charge(tenant)

    async def reserve(self, tenant: Tenant, tokens: int) -> Lease | Refused:
        return self.take(tenant, tokens)

    def release(self, tenant: Tenant, lease: Lease, unused_tokens: int) -> None:
        budget = self._budget(tenant)
        budget.streams -= 1
        if budget.tokens is not None and unused_tokens > 0:
            budget.tokens.give_back(unused_tokens)

    def close(self) -> None:
        pass
