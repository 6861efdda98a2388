"""Admission: per-tenant quotas (token buckets, concurrent streams) and the server-wide stream cap.

A request is admitted in this order, failing fast before it holds anything:
  1. the server is not draining (else UNAVAILABLE);
  2. prompt + max_new_tokens fits the tenant's max_tokens_per_request;
  3. the tenant has a free concurrent stream;
  4. the tenant's requests/min and tokens/min buckets cover it (tokens/min reserves prompt +
     max_new_tokens up front; the unused part is refunded when the request finishes);
  5. a server-wide generation slot is free, else it waits in a queue (bounded by max_queued_requests).
The queue is weighted: when a slot frees, it goes to the waiting tenant with the fewest running
streams per unit of priority_weight, so a tenant that floods the queue cannot starve the others.
Quota failures carry `retry_after_s`, which the server sends as `retry-after-s` trailing metadata.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable

from coordinator.tenancy import Tenant


class AdmissionError(Exception):
    def __init__(self, code: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


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


@dataclass
class Ticket:
    """One admitted request; pass it back to `Admission.release` exactly once."""

    tenant: Tenant
    reserved_tokens: int
    released: bool = False


class _TenantState:
    def __init__(self, tenant: Tenant, clock: Callable[[], float]):
        limits = tenant.limits
        self.requests = TokenBucket(limits.requests_per_minute, clock) if limits.requests_per_minute else None
        self.tokens = TokenBucket(limits.tokens_per_minute, clock) if limits.tokens_per_minute else None
        self.streams = 0  # running + waiting for a slot
        self.running = 0


class Admission:
    def __init__(self, max_concurrent: int, max_queued: int, clock: Callable[[], float] = time.monotonic):
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.draining = False
        self.running = 0
        self._clock = clock
        self._tenants: dict[str, _TenantState] = {}
        self._waiters: dict[str, deque[tuple[int, asyncio.Future]]] = defaultdict(deque)
        self._weights: dict[str, float] = {}
        self._arrival = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiters.values())

    def _state(self, tenant: Tenant) -> _TenantState:
        state = self._tenants.get(tenant.name)
        if state is None:
            state = self._tenants[tenant.name] = _TenantState(tenant, self._clock)
        return state

    async def admit(self, tenant: Tenant, tokens: int) -> Ticket:
        """`tokens` = prompt tokens + max_new_tokens. Raises AdmissionError; may wait for a slot."""
        if self.draining:
            raise AdmissionError("UNAVAILABLE", "server is shutting down; retry on another replica", 1.0)
        self._check_quota(tenant, tokens)
        state = self._state(tenant)
        state.streams += 1
        try:
            await self._take_slot(tenant)
        except BaseException:
            state.streams -= 1
            self._refund(state, tokens, 1)
            raise
        return Ticket(tenant=tenant, reserved_tokens=tokens)

    def _check_quota(self, tenant: Tenant, tokens: int) -> None:
        limits, state = tenant.limits, self._state(tenant)
        if limits.max_tokens_per_request and tokens > limits.max_tokens_per_request:
            raise AdmissionError(
                "RESOURCE_EXHAUSTED",
                f"request needs {tokens} tokens (prompt + max_new_tokens) but tenant {tenant.name!r} allows "
                f"{limits.max_tokens_per_request} per request; lower stopping.max_new_tokens or shorten the prompt",
            )
        if limits.max_concurrent_streams and state.streams >= limits.max_concurrent_streams:
            raise AdmissionError(
                "RESOURCE_EXHAUSTED",
                f"tenant {tenant.name!r} already has {state.streams} open streams (limit "
                f"{limits.max_concurrent_streams}); retry when one finishes",
                1.0,
            )
        if state.requests is not None:
            wait = state.requests.try_take(1)
            if wait:
                raise _rate_error(tenant, "requests_per_minute", limits.requests_per_minute, wait)
        if state.tokens is not None:
            wait = state.tokens.try_take(tokens)
            if wait:
                if state.requests is not None:
                    state.requests.give_back(1)
                if math.isinf(wait):
                    raise AdmissionError(
                        "RESOURCE_EXHAUSTED",
                        f"request needs {tokens} tokens but tenant {tenant.name!r} has tokens_per_minute "
                        f"{limits.tokens_per_minute}; lower stopping.max_new_tokens",
                    )
                raise _rate_error(tenant, "tokens_per_minute", limits.tokens_per_minute, wait)

    async def _take_slot(self, tenant: Tenant) -> None:
        state = self._state(tenant)
        if self.running < self.max_concurrent and not self.waiting:
            self.running += 1
            state.running += 1
            return
        if self.waiting >= self.max_queued:
            raise AdmissionError(
                "RESOURCE_EXHAUSTED",
                f"server is at capacity ({self.running} streams running, {self.waiting} queued); retry shortly",
                1.0,
            )
        future = asyncio.get_running_loop().create_future()
        entry = (next(self._arrival), future)
        self._weights[tenant.name] = tenant.priority_weight
        self._waiters[tenant.name].append(entry)
        try:
            await future  # resolved by _hand_out_slots with the slot already counted as running
        except BaseException:
            if future.done() and not future.cancelled():
                self.running -= 1  # slot was handed over just as we were cancelled: return it
                state.running -= 1
                self._hand_out_slots()
            else:
                self._waiters[tenant.name].remove(entry)
            raise

    def release(self, ticket: Ticket, used_tokens: int) -> None:
        """Frees the slot and stream; refunds the unused part of the tokens/min reservation."""
        if ticket.released:
            return
        ticket.released = True
        state = self._state(ticket.tenant)
        state.streams -= 1
        state.running -= 1
        self.running -= 1
        if state.tokens is not None and used_tokens < ticket.reserved_tokens:
            state.tokens.give_back(ticket.reserved_tokens - used_tokens)
        self._hand_out_slots()

    def _refund(self, state: _TenantState, tokens: int, requests: int) -> None:
        if state.tokens is not None:
            state.tokens.give_back(tokens)
        if state.requests is not None:
            state.requests.give_back(requests)

    def _hand_out_slots(self) -> None:
        while self.running < self.max_concurrent:
            candidates = [name for name, q in self._waiters.items() if q]
            if not candidates:
                return
            # Fewest running streams per unit of weight first; ties go to the earliest arrival.
            name = min(candidates, key=lambda n: (self._running_of(n) / self._weights[n], self._waiters[n][0][0]))
            _, future = self._waiters[name].popleft()
            if future.done():
                continue
            self.running += 1
            self._tenants[name].running += 1
            future.set_result(None)

    def _running_of(self, name: str) -> int:
        state = self._tenants.get(name)
        return state.running if state else 0


def _rate_error(tenant: Tenant, limit: str, value: int | None, wait_s: float) -> AdmissionError:
    wait_s = max(0.001, wait_s)
    return AdmissionError(
        "RESOURCE_EXHAUSTED",
        f"tenant {tenant.name!r} is over its {limit} limit ({value}); retry in {wait_s:.1f} s",
        wait_s,
    )
