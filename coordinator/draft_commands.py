"""What the drafter is told: every DraftCommand the scheduler sends (docs/design.md#the-pearl-protocol) — start a sequence,
advance it after a verdict, abort + roll back (a RESET, or the adoption of a hedge's branch), forward
the target's hidden states to a head drafter, release it — queued per event and sent as one message.

Mixed into `Scheduler` (coordinator/scheduler.py), whose state these methods read: `draft`,
`_draft_up`, `info`, `_pending_draft_commands`.
"""

from __future__ import annotations

import logging

from duospec.coordinator.kv_budget import cache_salt
from duospec.coordinator.sequence import Sequence
from duospec.internal.sampling_wire import sampling_to_proto
from duospec.internal.v1 import pearl_pb2 as pb

log = logging.getLogger(__name__)


class DraftCommands:
    def _start_draft(self, seq: Sequence) -> None:
        seq.draft_started = True
        seq.draft_fed_len = 0
        self._draft_command(
            pb.DraftCommand(
                seq_id=seq.seq_id,
                epoch=seq.epoch,
                kind=pb.DRAFT_COMMAND_KIND_START,
                start_pos=0,
                tail=seq.committed,
                draft_until=seq.draft_until(),
                sampling=sampling_to_proto(seq.request.sampling),
                pool=seq.request.tenant,
                cache_salt=cache_salt(self.info.prefix_cache, seq.request.tenant),
                committed_len=len(seq.committed),
                max_hedges=self._max_hedges(seq),
            )
        )

    @staticmethod
    def _max_hedges(seq: Sequence) -> int:
        """Hedges pay only on a rejection but cost draft steps always: adaptive pearl keeps
        2·(1 - α) of the configured number (at least one), α the sequence's acceptance."""
        n = 0 if seq.draft_paused else seq.policy.max_hedges()
        if n and seq.policy.adaptive:
            n = min(n, max(1, round(2 * n * (1 - seq.acceptance.alpha))))
        return n

    def _draft_command(self, command: pb.DraftCommand) -> None:
        """Queues a command; all commands of one event go to the drafter as one message (_dispatch)."""
        self._pending_draft_commands.append(command)

    def _flush_draft_commands(self) -> None:
        if self._pending_draft_commands and self._draft_up:
            self.draft.send(pb.DraftControl(commands=self._pending_draft_commands))
        self._pending_draft_commands = []

    def _forward_features(self, seq: Sequence, verdict: pb.Verdict) -> None:
        """The verdict's hidden states go to the head drafter before the command this verdict causes."""
        if not verdict.HasField("features"):  # a target backend without hidden states: go on target-only
            log.warning("seq %d: the target returned no hidden states for its %s drafter; it continues "
                        "target-only (serve the target on the lean backend)", seq.seq_id, self.info.draft_method)
            self._release_draft(seq)
            return
        seq.draft_exhausted = False  # the drafter may have been waiting for exactly these
        self._draft_command(pb.DraftCommand(seq_id=seq.seq_id, epoch=seq.epoch, kind=pb.DRAFT_COMMAND_KIND_FEATURES,
                                            features=verdict.features))

    def _release_draft(self, seq: Sequence) -> None:
        self._draft_command(pb.DraftCommand(seq_id=seq.seq_id, kind=pb.DRAFT_COMMAND_KIND_RELEASE))
        seq.drop_drafts()
        seq.draft_alive = False

    def _advance(self, seq: Sequence) -> None:
        seq.draft_exhausted = False  # the drafter knows more now: it may find more to propose
        self._draft_command(
            pb.DraftCommand(
                seq_id=seq.seq_id,
                epoch=seq.epoch,
                kind=pb.DRAFT_COMMAND_KIND_ADVANCE,
                draft_until=seq.draft_until(),
                committed_len=seq.drafter_verified_len(),
                max_hedges=self._max_hedges(seq),
            )
        )

    def _abort(self, seq: Sequence, hedge: tuple[list[int], list[bytes]] | None = None,
               key: tuple[int, int] | None = None) -> None:
        """Rejection: new epoch; the drafter rolls back to what it shares with the committed prefix.
        With `hedge` (tokens of the hedge `key`, default the token just committed: a cache hit) they
        become this epoch's drafts at once, and the drafter adopts the branch it drafted them on."""
        key = pb.HedgeKey(pos=key[0], token=key[1]) if key else pb.HedgeKey(pos=len(seq.committed) - 1,
                                                                           token=seq.committed[-1])
        start = seq.start_new_epoch()
        tail = seq.committed[start:]
        if hedge is not None:
            n = min(len(hedge[0]), seq.remaining)
            seq.drafts, seq.draft_probs = list(hedge[0][:n]), list(hedge[1][:n])
            seq.hedge_drafts = n
            seq.draft_fed_len = len(seq.committed) - 1 + n  # what the branch has fed
            tail = tail + seq.drafts
        self._draft_command(
            pb.DraftCommand(
                seq_id=seq.seq_id,
                epoch=seq.epoch,
                kind=pb.DRAFT_COMMAND_KIND_RESET,
                start_pos=start,
                tail=tail,
                draft_until=seq.draft_until(),
                committed_len=len(seq.committed),
                max_hedges=self._max_hedges(seq),
                adopt=key if hedge is not None else None,
            )
        )
