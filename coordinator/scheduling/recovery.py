"""What the scheduler does when a worker's stream breaks, stalls or hangs (Ray restarts the actor:
docs/design.md#processes-and-planes).

A lost drafter: live sequences go on target-only (same output) and the stream is reopened on the
restarted actor for later requests. A stalled drafter — its stream open but silent while sequences
wait for drafts, longer than DRAFT_STALL_STEPS of its measured step time (at least
DRAFT_STALL_FLOOR_S) — is treated as lost: its stream is closed and reopened, on a new actor if the
old one does not answer within the model's hang_timeout_s. A lost target: the coordinator waits for
the restart (up to the model's restart_timeout_s), re-sends every live sequence's committed tokens
(a re-prefill) and goes on; past the bound the live requests fail with UNAVAILABLE, and the
coordinator keeps reconnecting: while the target is down new requests are refused at once with
UNAVAILABLE and the server's health is NOT_SERVING (`target_serving`); once it is back both serve
again.

A hung worker never closes its stream, so it is found two ways: a verify outstanding longer than
hang_timeout_s (or VERIFY_HANG_FACTOR times its predicted cost, if that is longer), and the internal
streams' keepalive pings going unanswered (cluster/keepalive.py). Either way the link is lost as
for a dead worker — health NOT_SERVING at once, new requests UNAVAILABLE, live ones waiting for the
recovery — and the reconnection has Ray kill the actor and restart it (LinkLoss, pipeline.py)
instead of waiting on a process that will never answer. (Only where there is a way to restart: the
in-process links have none, and no verify watchdog.)

`WorkerSupervisor` owns both links, whether each worker is up, and the readers and watchdogs; the
drafter's link and its up flag live in its `DraftChannel` (coordinator/scheduling/draft_commands.py), which the
supervisor takes down and brings back. What a worker's batches and losses mean for the sequences is
the scheduler's: the supervisor tells it through `WorkerEvents`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from duospec.coordinator.scheduling.adaptive import VerifyCostModel
from duospec.coordinator.scheduling.draft_commands import DraftChannel
from duospec.coordinator.scheduling.links import Link, LinkLoss, Reconnect, close_quietly, loss_of
from duospec.coordinator.scheduling.patience import Patience
from duospec.coordinator.scheduling.rounds import InFlightVerify

log = logging.getLogger("coordinator.scheduler")

DRAFT_STALL_FLOOR_S = 3.0  # a drafter silent this long (or longer, see below) while sequences wait is stalled
DRAFT_STALL_STEPS = 100  # ... or this many of its measured steps, whichever is longer
VERIFY_HANG_FACTOR = 20  # a verify outstanding this many times its predicted cost (or hang_timeout_s) is hung
WATCH_INTERVAL_S = 0.25
RECONNECT_PAUSE_S = 1.0  # between reconnect attempts once a worker stayed away past its bound


def waits_for_drafter(seq, in_verify_with_drafts: bool) -> bool:
    """Whether a live sequence waits for its drafter's next chunk (what the stall watchdog watches);
    one in the batch the target works on, with drafts (`in_verify_with_drafts`), does not — an empty
    round's sequence still does."""
    return (seq.finish_reason is None and seq.draft_alive and not seq.draft_paused and not seq.draft_exhausted
            and not seq.drafts and not in_verify_with_drafts and seq.preempted_at is None
            # a head drafter rightly waits for the prompt's features until the target has read it
            and not (seq.needs_features and seq.target_len < len(seq.committed) - 1))


class WorkerEvents(Protocol):
    """What the supervisor tells the scheduler (coordinator/scheduling/scheduler.py), and asks it."""

    def on_draft_batch(self, batch) -> None: ...

    def on_verdict_batch(self, batch) -> None: ...

    def on_draft_lost(self) -> None: ...  # live sequences go on target-only

    def on_target_down(self) -> None: ...  # nothing in flight; every live sequence re-prefills

    def on_target_back(self) -> None: ...

    def on_target_lost(self) -> None: ...  # the target did not come back in time: fail the live requests

    def waiting_for_drafts(self) -> bool: ...  # some live sequence waits for the drafter's next chunk

    def verify_in_flight(self) -> InFlightVerify | None: ...


class WorkerSupervisor:
    def __init__(self, target: Link, drafter: DraftChannel, events: WorkerEvents, *, hang_timeout_s: float,
                 patience: Patience, verify_cost: VerifyCostModel, reconnect_target: Reconnect | None = None,
                 reconnect_draft: Reconnect | None = None):
        self.target = target
        self.drafter = drafter
        self._events = events
        self._hang_timeout_s = hang_timeout_s
        self._patience = patience  # its measured draft step and round overhead bound the waits
        self._verify_cost = verify_cost  # a verify's predicted cost bounds how long it may take
        # A lost stream is reopened on the restarted actor through these (pipeline.py).
        self.reconnect_target = reconnect_target
        self.reconnect_draft = reconnect_draft
        self.target_up = True
        self._target_failed = False  # the target did not come back: fail fast from now on
        self.target_restarts = 0
        self.draft_restarts = 0
        self.closed = False
        self._tasks: list[asyncio.Task] = []
        self._draft_heard_t = 0.0  # when the drafter last sent anything (monotonic)
        self._draft_stalled = False  # the watchdog closed the draft stream: its reader reopens it
        self._target_hung = False  # the watchdog closed the target stream: its reader replaces the target

    @property
    def draft(self) -> Link | None:
        return self.drafter.link

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._read_target(), name="duospec-target-reader"))
        if self.draft is not None:
            self._tasks.append(asyncio.create_task(self._read_draft(), name="duospec-draft-reader"))
            self._tasks.append(asyncio.create_task(self._watch_draft(), name="duospec-draft-watchdog"))
        if self.reconnect_target is not None:  # (a hung in-process target has nothing to restart it)
            self._tasks.append(asyncio.create_task(self._watch_target(), name="duospec-target-watchdog"))

    def stop(self) -> None:
        """From now on the coordinator is closed: readers and watchdogs end, nothing reconnects."""
        self.closed = True
        for task in self._tasks:
            task.cancel()

    async def close_links(self) -> None:
        for link in (self.draft, self.target):
            if link is not None:
                await link.close()

    def heard_from_drafter(self) -> float:
        """Notes that the drafter just sent something; returns when (monotonic)."""
        self._draft_heard_t = time.monotonic()
        return self._draft_heard_t

    @property
    def target_serving(self) -> bool:
        """Whether the target is connected: the server's health is SERVING only while it is."""
        return self.target_up and not self._target_failed and not self.closed

    # -- the drafter ----------------------------------------------------------------------------------
    async def _read(self, link: Link, on_batch, cut_by_watchdog) -> tuple[LinkLoss, Exception | None]:
        """Hands `link`'s batches to `on_batch` until its stream ends: (CLOSED, None) when it ended or
        its watchdog cancelled the read (`cut_by_watchdog()`), else how it broke and the error."""
        try:
            async for batch in link.responses():
                on_batch(batch)
        except asyncio.CancelledError:
            if self.closed or not cut_by_watchdog():
                raise
        except Exception as exc:  # the stream broke: the worker is gone (or hung: loss_of)
            return loss_of(exc), exc
        return LinkLoss.CLOSED, None

    async def _read_draft(self) -> None:
        """Reads draft chunks; when the stream breaks (or stalls), live sequences go on target-only and
        the link is reopened on the restarted drafter for later requests."""
        while not self.closed:
            loss, exc = await self._read(self.draft, self._events.on_draft_batch, lambda: self._draft_stalled)
            if exc is not None:
                log.warning("draft stream ended (%s, %s); live sequences continue target-only",
                            type(exc).__name__, loss.value)
            if self.closed:
                return
            if self._draft_stalled:
                loss = LinkLoss.SILENT
            self._draft_stalled = False
            self.drafter.lost()
            self._events.on_draft_lost()
            if self.reconnect_draft is None:
                return
            link = await self._reconnect(self.reconnect_draft, "drafter", loss)
            if link is None:
                return
            old = self.draft
            self.drafter.replaced(link)
            await close_quietly(old)
            self._draft_heard_t = time.monotonic()
            self.draft_restarts += 1
            log.info("drafter reconnected; new requests speculate again")

    def draft_stall_bound_s(self) -> float:
        return max(DRAFT_STALL_FLOOR_S, DRAFT_STALL_STEPS * (self._patience.draft_step_s.value or 0.0))

    async def _watch_draft(self) -> None:
        """Treats a drafter that stays silent while sequences wait for its drafts as lost."""
        waiting_since = None
        while not self.closed:
            await asyncio.sleep(WATCH_INTERVAL_S)
            waiting = self.drafter.up and self.target_up and self._events.waiting_for_drafts()
            now = time.monotonic()
            if not waiting or waiting_since is None or self._draft_heard_t > waiting_since:
                waiting_since = now if waiting else None
                continue
            if now - waiting_since > self.draft_stall_bound_s():
                log.warning("drafter silent for %.1f s while sequences wait for drafts; they continue "
                            "target-only and its stream is reopened", now - waiting_since)
                waiting_since = None
                self._draft_stalled = True
                await close_quietly(self.draft)  # ends its reader's stream: the lost-drafter path

    # -- the target -----------------------------------------------------------------------------------
    def verify_hang_bound_s(self, inflight) -> float:
        """How long the verify `inflight` may be outstanding before the target counts as hung."""
        predicted = self._verify_cost.cost(inflight.n_tokens) + (self._patience.round_overhead_s.value or 0.0)
        return max(self._hang_timeout_s, VERIFY_HANG_FACTOR * predicted)

    async def _watch_target(self) -> None:
        """Treats a target that sits on a verify far longer than it should take as hung."""
        while not self.closed:
            await asyncio.sleep(WATCH_INTERVAL_S)
            inflight = self._events.verify_in_flight()
            if inflight is None or not self.target_up:
                continue
            waited = time.monotonic() - inflight.sent_at
            if waited > self.verify_hang_bound_s(inflight):
                log.error("target silent for %.1f s on a verify of %d tokens (predicted %.3f s): treated as hung; "
                          "it is restarted", waited, inflight.n_tokens, self._verify_cost.cost(inflight.n_tokens))
                self._target_hung = True
                self.target_up = False  # NOT_SERVING, new requests refused: now, not once the stream ends
                await close_quietly(self.target)  # ends its reader's stream: the lost-target path

    async def _read_target(self) -> None:
        """Reads verdicts; when the stream breaks, waits for the restarted target and re-prefills every
        live sequence's committed tokens on it (nothing committed is lost)."""
        while not self.closed:
            loss, exc = await self._read(self.target, self._events.on_verdict_batch, lambda: self._target_hung)
            if exc is not None:
                log.error("target stream ended (%s, %s)", type(exc).__name__, loss.value)
            if self._target_hung:
                loss, self._target_hung = LinkLoss.HUNG, False
            if self.closed or not await self._recover_target(loss):
                return

    async def _recover_target(self, loss: LinkLoss) -> bool:
        self.target_up = False
        self._events.on_target_down()
        if self.reconnect_target is None:
            log.error("target stream ended and there is no way to reconnect")
            self.target_lost()
            return False
        link = await self._reconnect(self.reconnect_target, "target", loss, on_give_up=self.target_lost)
        if link is None:
            return False
        old, self.target = self.target, link
        await close_quietly(old)
        self.target_up = True
        self._target_failed = False
        self.target_restarts += 1
        self._events.on_target_back()
        return True

    async def _reconnect(self, reconnect, role: str, loss: LinkLoss, on_give_up=None):
        """Calls `reconnect(loss)` (which waits up to the restart bound) until it succeeds; after the
        first failure, `on_give_up` runs once (the live requests fail) and attempts go on. None when
        closed."""
        gave_up = False
        while not self.closed:
            try:
                return await reconnect(loss)
            except Exception as exc:
                if not gave_up:
                    log.error("%s did not come back in time (%s); still trying", role, exc)
                    gave_up = True
                    if on_give_up is not None:
                        on_give_up()
            loss = LinkLoss.CLOSED  # a worker replaced once: later attempts wait for that restart
            await asyncio.sleep(RECONNECT_PAUSE_S)
        return None

    def target_lost(self) -> None:
        """The target did not come back in time: the live requests fail, new ones fail fast."""
        self._target_failed = True
        self._events.on_target_lost()
