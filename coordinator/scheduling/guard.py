"""The goodput guard: speculate only while it commits more tokens per second than the target alone.

The adaptive draft length (coordinator/scheduling/adaptive.py) works from a cost model of the target's verify
forward; it cannot see what the model leaves out: a drafter that shares the target's device or CPU
cores, the hop to the drafter after every rejection, a draft that agrees only sometimes. The guard
does not model: it measures. Time is cut into windows of `window_rounds` verify rounds; each window
runs in one state — SPECULATE, or TARGET_ONLY (the drafters are paused, the target decodes alone,
with only the tokens a sequence's own text suggests: coordinator/scheduling/lookup.py) —
and yields its goodput, committed tokens per second of wall time. Goodput is kept per state and per
load bucket (how many sequences are live), since batching changes both. The guard runs the better
state and, now and then, one window of the other (a probe): the context may have changed (a draft
that starts agreeing on a repetitive stretch, load going down). Probes are spaced out exponentially
while they confirm the choice (`probe_every` .. `max_probe_every` windows), so the time spent in the
worse state stays a small, bounded share. The first choice in a load bucket rests on one window of
each state, the first one holding a request's start-up (prefill, the drafter's first draft), so when
it turns speculation off the guard checks it again soon (`confirm_every` windows): one unlucky
window must not decide most of a short run. One rule carries across buckets: when speculation lost
at a lighter load, a heavier bucket entered target-only measures speculation at its first regular
probe (`probe_every` windows) rather than at once — more load never makes speculation pay more.

Which sequences it governs is the scheduler's business: greedy pearl sequences with `adaptive` on.
Sampled requests keep speculating — a switch that depends on timing would decide some positions by
the target's own draw instead of the accept/reject rule, and seeded output must not depend on
timing. `vanilla` stays the fixed baseline.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable


class GuardState(enum.Enum):
    SPECULATE = "speculate"
    TARGET_ONLY = "target_only"

    @property
    def other(self) -> "GuardState":
        return GuardState.TARGET_ONLY if self is GuardState.SPECULATE else GuardState.SPECULATE


def load_bucket(live_sequences: int) -> int:
    """1, 2, 3-4, 5-8, 9-16, ...: windows are compared only within a bucket."""
    return max(0, live_sequences - 1).bit_length()


@dataclass
class _Window:
    state: GuardState
    rounds: int = 0
    live: int = 0  # sum over its rounds of the live sequences: the window's load is the mean
    tokens: int = 0
    seconds: float = 0.0  # busy wall time of its rounds (idle gaps between requests excluded)
    settle_left: int = 0


@dataclass
class GoodputGuard:
    window_rounds: int = 16  # a measurement window has at least this many verify rounds ...
    window_s: float = 0.25  # ... and lasts at least this long (shorter ones are mostly noise)
    settle_rounds: int = 2  # rounds not measured after a switch (drafters restart, caches refill)
    probe_every: int = 8  # windows in the preferred state before the first probe of the other
    confirm_every: int = 2  # ... after a bucket's first comparison switched speculation off
    max_probe_every: int = 64  # at 0.25 s a window: a losing state gets under 2 % of the time
    decay: float = 0.5  # weight of a bucket's older goodput when a new window comes in
    # A state must beat the other by this much to take over: when both are alike (e.g. the adaptive
    # length already stopped drafting) noise must not flip them back and forth.
    margin: float = 0.03
    clock: Callable[[], float] = time.monotonic
    state: GuardState = GuardState.SPECULATE
    # {(state, bucket): committed tokens per second}
    goodput: dict = field(default_factory=dict)
    rounds: dict = field(default_factory=lambda: {s: 0 for s in GuardState})  # verify rounds run in each state
    drafted_rounds: int = 0  # of those, rounds that verified drafts (speculation actually happened)
    switches: int = 0
    _window: _Window | None = None
    _last_at: float | None = None  # when the previous round ended (or work arrived after idling)
    _since_probe: int = 0
    _interval: int = 0
    _probing: bool = False

    def __post_init__(self) -> None:
        self._interval = self.probe_every

    @property
    def speculating(self) -> bool:
        return self.state is GuardState.SPECULATE

    def work_arrived(self) -> None:
        """A sequence arrived while none was live: time starts counting again from now."""
        self._last_at = self.clock()

    def observe_round(self, committed_tokens: int, live_sequences: int, drafted: bool = False,
                      decode_only: bool = True) -> None:
        """One verify round came back having committed `committed_tokens` for the governed sequences,
        with `live_sequences` of them live (before the round's verdicts were applied); `drafted`: it
        verified draft tokens. A round's time runs from the previous round (or the arrival of work)
        to now: what speculation makes the target wait for counts, idle time does not.
        `decode_only=False` (the round also read prompt tokens): not measured — a window that happens
        to hold a wave of prompt prefills would look slow whatever its state, and requests arriving
        together made exactly the target-only probes look 35 % slower than `off` at 8 streams."""
        now = self.clock()
        seconds = now - self._last_at if self._last_at is not None else None
        self._last_at = now
        self.rounds[self.state] += 1
        self.drafted_rounds += drafted
        if not decode_only:
            return
        w = self._window
        if w is None or w.state is not self.state:
            w = self._window = _Window(self.state, settle_left=self.settle_rounds)
        if w.settle_left > 0 or seconds is None:  # began before the window's state was in force
            w.settle_left = max(0, w.settle_left - 1)
            return
        w.rounds += 1
        w.tokens += committed_tokens
        w.seconds += seconds
        w.live += live_sequences
        if w.rounds >= self.window_rounds and w.seconds >= self.window_s:
            # A window's load is its mean: restarting windows whenever the live count crossed a
            # bucket edge would let a churning load keep every window from closing.
            self._close_window(w, load_bucket(round(w.live / w.rounds)), w.tokens / w.seconds)
            self._window = None

    def _close_window(self, w: _Window, bucket: int, rate: float) -> None:
        key = (w.state, bucket)
        old = self.goodput.get(key)
        self.goodput[key] = rate if old is None else self.decay * old + (1 - self.decay) * rate
        mine, theirs = self.goodput.get(key), self.goodput.get((w.state.other, bucket))
        first = old is None  # this state's first window in the bucket
        if self._probing:  # the probe's verdict: stay (it won clearly) or go back
            self._probing = False
            if theirs is not None and mine <= theirs * (1 + self.margin):
                self._interval = min(self._interval * 2, self.max_probe_every)  # the choice holds
                self._switch(w.state.other)
            elif first and w.state is GuardState.TARGET_ONLY:
                self._interval = self.confirm_every  # off on one window each: look again soon
            else:
                self._interval = self.probe_every  # the probed state is better now: keep it
            return
        # Speculation unmeasured at this load but it lost at a lighter one: measure it at the first
        # regular probe, not at once.
        deferred = theirs is None and w.state is GuardState.TARGET_ONLY and self._lost_at_lighter_load(bucket)
        if deferred and first:  # this bucket's probe schedule starts now, whatever a lighter one's was
            self._interval, self._since_probe = self.probe_every, 0
        if not deferred and (theirs is None or theirs > mine * (1 + self.margin)):  # unmeasured, or clearly better
            if theirs is not None:
                self._interval = self.probe_every
            self._probing = theirs is None
            self._switch(w.state.other)
            return
        self._since_probe += 1
        if self._since_probe >= self._interval:
            self._probing = True
            self._switch(w.state.other)

    def _lost_at_lighter_load(self, bucket: int) -> bool:
        """Whether, at the heaviest lighter load bucket where both states were measured, speculation
        lost. More sequences in a batch only make a verify's extra rows dearer relative to what the
        batch commits anyway (the reason vLLM turns speculation off above a batch size), so a bucket
        entered target-only after that stays so until its first regular probe instead of measuring
        speculation at once: a short burst at a new load then pays no learning phase."""
        lighter = [b for (state, b) in self.goodput if state is GuardState.SPECULATE and b < bucket
                   and (GuardState.TARGET_ONLY, b) in self.goodput]
        if not lighter:
            return False
        b = max(lighter)
        return self.goodput[(GuardState.SPECULATE, b)] < self.goodput[(GuardState.TARGET_ONLY, b)]

    def _switch(self, state: GuardState) -> None:
        self._since_probe = 0
        if state is not self.state:
            self.state = state
            self.switches += 1

    def stats(self) -> dict:
        total = sum(self.rounds.values())
        return {
            "state": self.state.value,
            "speculating_share": self.rounds[GuardState.SPECULATE] / total if total else 1.0,
            "rounds": total,
            "drafted_rounds": self.drafted_rounds,  # rounds that verified drafts, in either state
            "switches": self.switches,
            "goodput": {f"{s.value}@{1 << b if b else 1}": round(r, 1) for (s, b), r in sorted(
                self.goodput.items(), key=lambda kv: (kv[0][1], kv[0][0].value))},
        }
