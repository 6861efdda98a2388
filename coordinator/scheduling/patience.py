"""Pearl patience: hold the free target briefly when a fuller draft chunk commits more per second.

Right after a rejection the drafter restarts from the corrected token, so when the target frees up
no draft, or only one or a few, exists. Pre-verifying what is there at once is PEARL's rule; with no
draft at all, a greedy sequence can even go with none (the target's bonus is its next token, and
what the drafter drafts meanwhile continues it when it guessed that token). Waiting a few steps for
a longer chunk can commit more tokens per second instead; coordinator/scheduling/adaptive.py weighs the two
(drafts_worth_waiting_for, with the drafter's step time, its restart time and the round overhead
measured here). Each wait is bounded by a timer: a drafter that stalls or dies costs at most that
long per round, until the stall watchdog (coordinator/scheduling/recovery.py) takes it out.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Iterable

from duospec.coordinator.scheduling.adaptive import Ewma

# The longest hold, in multiples of the expected time for the awaited drafts, plus a margin for
# transport jitter.
HOLD_FACTOR = 2.0
HOLD_MARGIN_S = 0.001


class Patience:
    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake  # called when a hold times out (the scheduler's dispatch)
        self.draft_step_s = Ewma()  # seconds per drafter step, from its busy time per message
        self.round_overhead_s = Ewma()  # verify round trip minus the target's own time
        # from a rejection's RESET (nothing cached) to the restarted drafter's first draft
        self.first_draft_s = Ewma()
        self._until: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        # Set by the timer itself: a loop may run a timer a little before `_until` by its own clock,
        # and a hold must end when its timer fires whatever the clocks say.
        self._expired = False
        self.holds = 0  # how many times the target was held (stats)

    @property
    def expired(self) -> bool:
        """The current hold has run out: what is ready goes, whatever it would rather wait for."""
        return self._expired or (self._until is not None and time.monotonic() >= self._until)

    def hold(self, waits_s: Iterable[float]) -> bool:
        """Whether to keep the target waiting: every ready sequence wants more drafts (each value of
        `waits_s`, the expected seconds until they are there, > 0; consumed lazily, up to the first 0)
        and the current hold has not timed out."""
        if self.expired:
            return False
        wanted = []
        for wait in waits_s:
            if wait <= 0:
                return False
            wanted.append(wait)
        if not wanted:
            return False
        if self._until is None:
            now = time.monotonic()
            limit = HOLD_FACTOR * max(wanted) + HOLD_MARGIN_S
            self._until = now + limit
            self._timer = asyncio.get_running_loop().call_later(limit, self._expire)
            self.holds += 1
        return True

    def _expire(self) -> None:
        self._expired = True
        self._wake()

    def end(self) -> None:
        """The target got a batch (or the scheduler closes): no hold in progress."""
        if self._timer is not None:
            self._timer.cancel()
        self._until = self._timer = None
        self._expired = False
