"""Admission: per-tenant quotas (token buckets, concurrent streams) and the one place requests wait.

A request is admitted in this order, failing fast before it holds anything:
  1. the server is not draining (else UNAVAILABLE);
  2. prompt + max_new_tokens fits the tenant's max_tokens_per_request;
  3. the tenant has a free concurrent stream;
  4. the tenant's requests/min and tokens/min buckets cover it (requests/min is charged first, by
     `charge_request`, before the request is even tokenized, so rejected requests count too;
     tokens/min reserves prompt + max_new_tokens up front; the unused part is refunded at the end);
  5. a generation slot is free — server-wide (max_concurrent_requests) and on the model
     (models[].max_num_seqs, the sequences its scheduler holds) — else it waits in the queue.
The queue is weighted: when a slot frees, it goes to the waiting tenant with the fewest running
streams per unit of priority_weight. Because the model's slots are handed out here and nowhere else,
no admitted request waits in a FIFO further down. Each tenant's part of the queue is bounded by its
weighted share of max_queued_requests (weights of every tenant in the tenants file), so a tenant
that floods the queue is refused on its own share and cannot crowd the others out of theirs.
Quota failures carry `retry_after_s`, which the server sends as `retry-after-s` trailing metadata.

Steps 3 and 4 ask a quota store (quota.py): this process's buckets, or with a PostgreSQL ledger the
budgets every gateway shares (quota_postgres.py). Step 5 is this gateway's own.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable, Iterable

from duospec.coordinator.tenants.quota import LocalQuotas, Lease, QuotaStore, Refused
from duospec.coordinator.tenants.tenancy import Tenant


class AdmissionError(Exception):
    def __init__(self, code: str, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


@dataclass
class Ticket:
    """One admitted request; pass it back to `Admission.release` exactly once."""

    tenant: Tenant
    reserved_tokens: int
    lease: Lease
    model: str = ""
    released: bool = False


@dataclass
class _TenantState:
    running: int = 0  # streams of this tenant holding a slot on this gateway (what the queue weighs)


class Admission:
    """`model_slots`: name -> max_num_seqs; a model not listed is bounded only by max_concurrent.
    `quotas`: where the tenants' budgets are kept (default: this process, on `clock`)."""

    def __init__(self, max_concurrent: int, max_queued: int, clock: Callable[[], float] = time.monotonic,
                 *, model_slots: dict[str, int] | None = None, tenants: Iterable[Tenant] = (),
                 quotas: QuotaStore | None = None):
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.model_slots = dict(model_slots or {})
        self.draining = False
        self.running = 0
        self.quotas = quotas if quotas is not None else LocalQuotas(clock)
        self._tenants: dict[str, _TenantState] = {}
        self._model_running: dict[str, int] = defaultdict(int)
        self._waiters: dict[str, deque[tuple[int, str, asyncio.Future]]] = defaultdict(deque)
        self._weights: dict[str, float] = {}
        self._arrival = itertools.count()
        self.set_tenants(tenants)

    def set_tenants(self, tenants: Iterable[Tenant]) -> None:
        """The tenants whose weights split the queue (the tenants file; again after a reload, when a
        tenant whose limits changed gets buckets for its new limits)."""
        tenants = list(tenants)
        self._known_weights = {t.name: t.priority_weight for t in tenants}
        self.quotas.set_tenants(tenants)

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiters.values())

    def queue_share(self, tenant: Tenant) -> int:
        """How many of this tenant's requests may wait at once: its weighted share of the queue."""
        weights = dict(self._known_weights)
        weights[tenant.name] = tenant.priority_weight
        return max(1, math.floor(self.max_queued * tenant.priority_weight / sum(weights.values())))

    def _state(self, tenant: Tenant) -> _TenantState:
        state = self._tenants.get(tenant.name)
        if state is None:
            state = self._tenants[tenant.name] = _TenantState()
        return state

    async def admit(self, tenant: Tenant, tokens: int, model: str = "") -> Ticket:
        """`tokens` = prompt tokens + max_new_tokens; call `charge_request` first. Raises AdmissionError;
        may wait for a slot."""
        if self.draining:
            raise AdmissionError("UNAVAILABLE", "server is shutting down; retry on another replica", 1.0)
        lease = await self._reserve(tenant, tokens)
        try:
            await self._take_slot(tenant, model)
        except BaseException:
            self.quotas.release(tenant, lease, tokens)
            raise
        return Ticket(tenant=tenant, reserved_tokens=tokens, lease=lease, model=model)

    async def charge_request(self, tenant: Tenant) -> None:
        """Counts one request against requests/min before anything else is done for it (tokenizing,
        templating), so requests that are then rejected still count. Raises AdmissionError."""
        if tenant.limits.requests_per_minute:
            wait = await self.quotas.charge_request(tenant)
            if wait:
                raise _rate_error(tenant, "requests_per_minute", tenant.limits.requests_per_minute, wait)

    async def _reserve(self, tenant: Tenant, tokens: int) -> Lease:
        limits = tenant.limits
        if limits.max_tokens_per_request and tokens > limits.max_tokens_per_request:
            raise AdmissionError(
                "RESOURCE_EXHAUSTED",
                f"request needs {tokens} tokens (prompt + max_new_tokens) but tenant {tenant.name!r} allows "
                f"{limits.max_tokens_per_request} per request; lower stopping.max_new_tokens or shorten the prompt",
            )
        lease = await self.quotas.reserve(tenant, tokens)
        if not isinstance(lease, Refused):
            return lease
        if lease.limit == "max_concurrent_streams":
            raise AdmissionError(
                "RESOURCE_EXHAUSTED",
                f"tenant {tenant.name!r} already has {lease.value:.0f} open streams (limit "
                f"{limits.max_concurrent_streams}); retry when one finishes",
                1.0,
            )
        if math.isinf(lease.value):
            raise AdmissionError(
                "RESOURCE_EXHAUSTED",
                f"request needs {tokens} tokens but tenant {tenant.name!r} has tokens_per_minute "
                f"{limits.tokens_per_minute}; lower stopping.max_new_tokens",
            )
        raise _rate_error(tenant, "tokens_per_minute", limits.tokens_per_minute, lease.value)

    def _has_room(self, model: str) -> bool:
        return (self.running < self.max_concurrent
                and self._model_running[model] < self.model_slots.get(model, self.max_concurrent))

    def _count(self, tenant_name: str, model: str, delta: int) -> None:
        self.running += delta
        self._model_running[model] += delta
        self._tenants[tenant_name].running += delta

    async def _take_slot(self, tenant: Tenant, model: str) -> None:
        state = self._state(tenant)
        if self._has_room(model) and not any(m == model for q in self._waiters.values() for _, m, _ in q):
            self._count(tenant.name, model, +1)
            return
        if self.waiting >= self.max_queued:
            raise AdmissionError(
                "RESOURCE_EXHAUSTED",
                f"server is at capacity ({self.running} streams running, {self.waiting} queued); retry shortly",
                1.0,
            )
        share = self.queue_share(tenant)
        if len(self._waiters[tenant.name]) >= share:
            raise AdmissionError(
                "RESOURCE_EXHAUSTED",
                f"tenant {tenant.name!r} already has {share} requests queued, its share of the queue "
                f"(by priority_weight); retry when one starts",
                1.0,
            )
        future = asyncio.get_running_loop().create_future()
        entry = (next(self._arrival), model, future)
        self._weights[tenant.name] = tenant.priority_weight
        self._waiters[tenant.name].append(entry)
        try:
            await future  # resolved by _hand_out_slots with the slot already counted as running
        except BaseException:
            if future.done() and not future.cancelled():
                self._count(tenant.name, model, -1)  # slot was handed over just as we were cancelled
                self._hand_out_slots()
            elif entry in self._waiters[tenant.name]:  # (_hand_out_slots may have dropped it already)
                self._waiters[tenant.name].remove(entry)
            raise

    def release(self, ticket: Ticket, used_tokens: int) -> None:
        """Frees the slot and stream; refunds the unused part of the tokens/min reservation."""
        if ticket.released:
            return
        ticket.released = True
        self._count(ticket.tenant.name, ticket.model, -1)
        self.quotas.release(ticket.tenant, ticket.lease, max(0, ticket.reserved_tokens - used_tokens))
        self._hand_out_slots()

    def _hand_out_slots(self) -> None:
        while self.running < self.max_concurrent:
            # Each tenant's earliest request for a model with a free slot.
            candidates = []
            for name, queue in self._waiters.items():
                entry = next((e for e in queue if self._has_room(e[1])), None)
                if entry is not None:
                    candidates.append((name, entry))
            if not candidates:
                return
            # Fewest running streams per unit of weight first; ties go to the earliest arrival.
            name, entry = min(candidates, key=lambda c: (self._running_of(c[0]) / self._weights[c[0]], c[1][0]))
            self._waiters[name].remove(entry)
            _, model, future = entry
            if future.done():
                continue
            self._count(name, model, +1)
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
