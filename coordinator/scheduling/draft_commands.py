"""What the drafter is told: every DraftCommand the scheduler sends (docs/design.md#the-pearl-protocol) — start a sequence,
advance it after a verdict, abort + roll back (a RESET, or the adoption of a hedge's branch), forward
the target's hidden states to a head drafter, release it — queued per event and sent as one message.
After a verdict, `after_verdict` turns its outcome (Sequence.apply_verdict) into the command it needs.

`DraftChannel` owns the drafter's side of the scheduler: its link, whether it is up (the worker
supervisor, coordinator/scheduling/recovery.py, takes it down and brings it back) and the commands queued for
the next message.
"""

from __future__ import annotations

import logging
import time

from duospec.coordinator.scheduling.kv_budget import cache_salt
from duospec.coordinator.scheduling.sequence import DraftAction, Sequence, VerdictOutcome
from duospec.draft_worker.proposer import DraftMethod
from duospec.internal.constraint_wire import constraint_to_proto
from duospec.internal.sampling_wire import sampling_to_proto
from duospec.internal.v1 import pearl_pb2 as pb

log = logging.getLogger(__name__)


def max_hedges(seq: Sequence) -> int:
    """The hedges `seq`'s drafter may hold now (SpeculationPolicy.hedges_now)."""
    return seq.policy.hedges_now(seq.acceptance.alpha, seq.draft_paused)


class DraftChannel:
    """The drafter's link and the commands for it; `link` None: the model has no drafter."""

    def __init__(self, link, prefix_cache: str, draft_method: str | None):
        self.link = link
        self.up = link is not None  # False while the drafter is lost: sequences go on target-only
        self.pending: list[pb.DraftCommand] = []  # this event's commands, sent as one message (flush)
        self._prefix_cache = prefix_cache
        self._method = draft_method

    @property
    def reads_features(self) -> bool:
        """Whether the drafter drafts from the target's hidden states (a head: EAGLE, Medusa)."""
        return self._method is not None and DraftMethod(self._method).reads_features

    def lost(self) -> None:
        self.up = False

    def replaced(self, link) -> None:
        """The drafter is back on `link` (a restarted actor)."""
        self.link, self.up = link, True

    def command(self, command: pb.DraftCommand) -> None:
        """Queues a command; all commands of one event go to the drafter as one message (flush)."""
        self.pending.append(command)

    def flush(self) -> None:
        if self.pending and self.up:
            self.link.send(pb.DraftControl(commands=self.pending))
        self.pending = []

    def start(self, seq: Sequence) -> None:
        seq.draft_started = True
        seq.draft_fed_len = 0
        self.command(
            pb.DraftCommand(
                seq_id=seq.seq_id,
                epoch=seq.epoch,
                kind=pb.DRAFT_COMMAND_KIND_START,
                start_pos=0,
                tail=seq.committed,
                draft_until=seq.draft_until(),
                sampling=sampling_to_proto(seq.request.sampling),
                pool=seq.request.tenant,
                cache_salt=cache_salt(self._prefix_cache, seq.request.tenant),
                committed_len=len(seq.committed),
                max_hedges=max_hedges(seq),
                constraint=_draft_constraint(seq),
            )
        )

    def forward_features(self, seq: Sequence, verdict: pb.Verdict) -> None:
        """The verdict's hidden states go to the head drafter before the command this verdict causes."""
        if not verdict.HasField("features"):  # a target backend without hidden states: go on target-only
            log.warning("seq %d: the target returned no hidden states for its %s drafter; it continues "
                        "target-only (serve the target on the lean backend)", seq.seq_id, self._method)
            self.release(seq)
            return
        seq.draft_exhausted = False  # the drafter may have been waiting for exactly these
        self.command(pb.DraftCommand(seq_id=seq.seq_id, epoch=seq.epoch, kind=pb.DRAFT_COMMAND_KIND_FEATURES,
                                     features=verdict.features))

    def release(self, seq: Sequence) -> None:
        """The drafter drops `seq` for good: it goes on target-only (or has ended)."""
        self.free(seq)
        seq.drop_drafts()
        seq.draft_alive = False

    def free(self, seq: Sequence) -> None:
        """The drafter frees `seq`'s blocks; the sequence keeps its drafter (a preemption restarts it)."""
        self.command(pb.DraftCommand(seq_id=seq.seq_id, kind=pb.DRAFT_COMMAND_KIND_RELEASE))

    def advance(self, seq: Sequence) -> None:
        seq.draft_exhausted = False  # the drafter knows more now: it may find more to propose
        self.command(
            pb.DraftCommand(
                seq_id=seq.seq_id,
                epoch=seq.epoch,
                kind=pb.DRAFT_COMMAND_KIND_ADVANCE,
                draft_until=seq.draft_until(),
                committed_len=seq.drafter_verified_len(),
                max_hedges=max_hedges(seq),
            )
        )

    def abort(self, seq: Sequence, hedge: tuple[list[int], list[bytes]] | None = None,
              key: tuple[int, int] | None = None) -> None:
        """Rejection: new epoch; the drafter rolls back to what it shares with the committed prefix.
        With `hedge` (tokens of the hedge `key`, default the token just committed: a cache hit) they
        become this epoch's drafts at once, and the drafter adopts the branch it drafted them on."""
        key = pb.HedgeKey(pos=key[0], token=key[1]) if key else pb.HedgeKey(pos=len(seq.committed) - 1,
                                                                           token=seq.committed[-1])
        start = seq.start_new_epoch()
        tail = seq.committed[start:]
        if hedge is not None:
            tail = tail + seq.adopt_hedge(hedge)
        self.command(
            pb.DraftCommand(
                seq_id=seq.seq_id,
                epoch=seq.epoch,
                kind=pb.DRAFT_COMMAND_KIND_RESET,
                start_pos=start,
                tail=tail,
                draft_until=seq.draft_until(),
                committed_len=len(seq.committed),
                max_hedges=max_hedges(seq),
                adopt=key if hedge is not None else None,
            )
        )

    # -- after a verdict ----------------------------------------------------------------------------
    def after_verdict(self, seq: Sequence, outcome: VerdictOutcome, backed_off: bool) -> None:
        """Tells the drafter what a verdict means for it. `backed_off`: the scheduler wants no drafts
        for `seq` now (load, or the goodput guard): the drafter stops, and a paused one resumes with
        a catch-up RESET once drafts are wanted again."""
        if outcome.action is DraftAction.NONE:
            return
        if backed_off:
            self._pause(seq, outcome)
        elif seq.draft_paused:
            self._resume(seq, outcome)
        else:
            match outcome.action:
                case DraftAction.ADVANCE:
                    if outcome.kept:  # (nothing committed, e.g. a prefill-only round: nothing new to hear)
                        self.advance(seq)
                case DraftAction.ABORT:
                    self._restart(seq)
                case DraftAction.ADOPT:
                    self._adopt(seq, outcome)

    def _pause(self, seq: Sequence, outcome: VerdictOutcome) -> None:
        """Back-off: stop the drafter, go target-only."""
        if seq.draft_paused:
            seq.drop_drafts()
            return
        seq.pause_drafting()
        if outcome.new_epoch:  # the drafter's rejected tokens must go, not just stop
            self.abort(seq)
        else:
            self.advance(seq)

    def _resume(self, seq: Sequence, outcome: VerdictOutcome) -> None:
        """Drafts are wanted again: a RESET brings the drafter up to date (no cache lookup, no restart
        timed: it drafted nothing while paused)."""
        seq.draft_paused = False
        if outcome.action is DraftAction.ADOPT:
            self._adopt(seq, outcome)
        else:
            self.abort(seq)

    def _restart(self, seq: Sequence) -> None:
        """A rejection: the speculation cache's hedge for the correction, if it holds one, becomes the
        drafts at once; else the drafter starts over from the correction, its first draft timed."""
        cached = seq.take_hedge() if max_hedges(seq) else None
        self.abort(seq, cached)
        if cached is None:
            seq.spec.drafter_restarted(seq.epoch, time.monotonic())

    def _adopt(self, seq: Sequence, outcome: VerdictOutcome) -> None:
        """The verdict's path went into a hedge's branch: the drafter continues on that branch."""
        branch = outcome.branch
        self.abort(seq, (branch.drafts, branch.probs), branch.key)


def _draft_constraint(seq: Sequence) -> pb.GrammarConstraint | None:
    """The request's constraint for the drafter (it masks its proposals; the target still decides)."""
    constraint = seq.request.constraint
    if constraint is None:
        return None
    return constraint_to_proto(constraint, seq.request.output_start, seq.eos_token_ids)
