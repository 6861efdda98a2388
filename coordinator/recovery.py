"""What the scheduler does when a worker's stream breaks (DESIGN.md §2: Ray restarts the actor).

A lost drafter: live sequences go on target-only (same output) and the stream is reopened on the
restarted actor for later requests. A lost target: the coordinator waits for the restart, re-sends
every live sequence's committed tokens (a re-prefill) and goes on; past the restart bound the live
requests fail with UNAVAILABLE. Mixed into `Scheduler` (coordinator/scheduler.py), whose state
these methods read and write: the links, `sequences`, `inflight`, the `_target_up`/`_draft_up` flags.
"""

from __future__ import annotations

import asyncio
import logging

from coordinator.api import Unavailable
from coordinator.links import close_quietly

log = logging.getLogger("coordinator.scheduler")


class WorkerRecovery:
    async def _read_draft(self) -> None:
        """Reads draft chunks; when the stream breaks, live sequences go on target-only and the link is
        reopened on the restarted drafter for later requests."""
        while not self.closed:
            try:
                async for batch in self.draft.responses():
                    self._on_draft_batch(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the stream broke: the drafter is gone
                log.warning("draft stream ended (%s); live sequences continue target-only", type(exc).__name__)
            if self.closed:
                return
            self._draft_up = False
            self._draft_lost()
            if self._reconnect_draft is None:
                return
            try:
                link = await self._reconnect_draft()
            except Exception as exc:
                log.error("drafter did not come back (%s); serving target-only", exc)
                return
            old, self.draft = self.draft, link
            await close_quietly(old)
            self._draft_up = True
            self.draft_restarts += 1
            log.info("drafter reconnected; new requests speculate again")

    def _draft_lost(self) -> None:
        for seq in self.sequences.values():
            if seq.draft_alive:
                seq.drop_drafts()
                seq.draft_alive = False
        if not self.closed:
            self._dispatch()

    async def _read_target(self) -> None:
        """Reads verdicts; when the stream breaks, waits for the restarted target and re-prefills every
        live sequence's committed tokens on it (nothing committed is lost)."""
        while not self.closed:
            try:
                async for batch in self.target.responses():
                    self._on_verdict_batch(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.error("target stream ended (%s)", type(exc).__name__)
            if self.closed or not await self._recover_target():
                return

    async def _recover_target(self) -> bool:
        self._target_up = False
        self.inflight = None
        self._target_releases = []  # the restarted target holds no sequences
        for seq in self.sequences.values():
            seq.target_len = 0  # the next verify re-sends all committed tokens: a re-prefill
            seq.forget_verify()
        try:
            if self._reconnect_target is None:
                raise ConnectionError("no way to reconnect")
            link = await self._reconnect_target()
        except Exception as exc:
            log.error("target did not come back: %s", exc)
            self._target_lost()
            return False
        old, self.target = self.target, link
        await close_quietly(old)
        self._target_up = True
        self.target_restarts += 1
        log.info("target reconnected; re-prefilling %d live sequences", len(self.sequences))
        self._dispatch()
        return True

    def _target_lost(self) -> None:
        self._target_failed = True
        self.inflight = None
        for seq in list(self.sequences.values()):
            self._fail(seq, Unavailable("the target worker is unavailable and did not restart in time; retry later"))
