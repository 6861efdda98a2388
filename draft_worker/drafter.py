"""The drafter's model loop: per-sequence KV state and continuous, batched drafting.

The drafter holds no scheduling policy. Each sequence has a lookahead bound (`draft_until`, an
absolute position) set by the coordinator; every `step()` drafts one token for every sequence below
its bound, in one ragged batched forward. An abort (RESET) takes effect at the next step: the slot is
rolled back by the engine when the next chunk starts at an earlier position.

Sampling: the drafter samples from exactly the q it sends (`qcodec.draft_sample` decodes its own
16-bit q before sampling), keyed by (seed, position, DRAFT) so re-drafting a position after an
abort is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from duospec.engine import ModelRunner, SlotChunk
from duospec.internal.sampling_wire import sampling_from_proto
from duospec.internal.v1 import pearl_pb2 as pb
from duospec.qcodec import draft_sample
from duospec.sampling import SamplingParams


@dataclass
class DraftSequence:
    slot: int
    epoch: int
    sampling: SamplingParams
    feed_pos: int  # position of to_feed[0]; everything before it is in the KV cache
    to_feed: list[int]  # tokens known but not yet fed (the tail, then the last drafted token)
    draft_until: int  # draft positions < draft_until only
    tokens_drafted: int = 0

    @property
    def next_pos(self) -> int:
        """The position the next drafted token will occupy."""
        return self.feed_pos + len(self.to_feed)

    @property
    def may_draft(self) -> bool:
        return self.next_pos < self.draft_until


@dataclass
class DrafterStats:
    steps: int = 0
    tokens: int = 0
    sequences: dict = field(default_factory=dict)


class Drafter:
    """Draft model state for every live sequence; `apply` commands, then `step` to draft."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.sequences: dict[int, DraftSequence] = {}
        self.steps = 0
        self.tokens_drafted = 0

    # -- commands -------------------------------------------------------------------------------
    def apply(self, cmd: pb.DraftCommand) -> None:
        kind = cmd.kind
        if kind == pb.DRAFT_COMMAND_KIND_START:
            self._start(cmd)
        elif kind == pb.DRAFT_COMMAND_KIND_RESET:
            seq = self.sequences.get(cmd.seq_id)
            if seq is None:  # e.g. the drafter restarted: a reset carries everything needed to start
                return
            seq.epoch = cmd.epoch
            seq.feed_pos = cmd.start_pos
            seq.to_feed = list(cmd.tail)
            seq.draft_until = cmd.draft_until
        elif kind == pb.DRAFT_COMMAND_KIND_ADVANCE:
            seq = self.sequences.get(cmd.seq_id)
            if seq is not None and cmd.epoch == seq.epoch:
                seq.draft_until = cmd.draft_until
        elif kind == pb.DRAFT_COMMAND_KIND_RELEASE:
            self.release(cmd.seq_id)
        else:
            raise ValueError(f"unknown draft command kind {kind}")

    def _start(self, cmd: pb.DraftCommand) -> None:
        if cmd.seq_id in self.sequences:
            self.release(cmd.seq_id)
        if not cmd.tail:
            raise ValueError(f"sequence {cmd.seq_id}: START needs at least one token to feed")
        slot = self.runner.allocate_slot()
        self.sequences[cmd.seq_id] = DraftSequence(
            slot=slot,
            epoch=cmd.epoch,
            sampling=sampling_from_proto(cmd.sampling),
            feed_pos=cmd.start_pos,
            to_feed=list(cmd.tail),
            draft_until=cmd.draft_until,
        )

    def release(self, seq_id: int) -> None:
        seq = self.sequences.pop(seq_id, None)
        if seq is not None:
            self.runner.free_slot(seq.slot)

    def drop_drafting(self) -> list[int]:
        """Releases every sequence that was about to draft (after a failed step); returns their ids."""
        ids = [seq_id for seq_id, seq in self.sequences.items() if seq.may_draft]
        for seq_id in ids:
            self.release(seq_id)
        return ids

    def release_all(self) -> None:
        for seq_id in list(self.sequences):
            self.release(seq_id)

    # -- drafting -------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return any(seq.may_draft for seq in self.sequences.values())

    def step(self) -> list[pb.DraftChunk]:
        """Drafts one token for every sequence below its bound; returns one chunk per sequence."""
        active = [(seq_id, seq) for seq_id, seq in self.sequences.items() if seq.may_draft]
        if not active:
            return []
        # Clip to the model's context: a sequence at the end of the context stops drafting.
        max_pos = self.runner.max_context
        active = [(i, s) for i, s in active if s.next_pos < max_pos]
        if not active:
            return []
        logits = self.runner.forward_last([SlotChunk(s.slot, s.feed_pos, s.to_feed) for _, s in active])
        chunks = []
        for row, (seq_id, seq) in enumerate(active):
            pos = seq.next_pos
            token, q = draft_sample(logits[row], seq.sampling, pos)
            chunks.append(
                pb.DraftChunk(
                    seq_id=seq_id,
                    epoch=seq.epoch,
                    start_pos=pos,
                    tokens=[token],
                    draft_probs=[q.to_bytes()] if q is not None else [],
                )
            )
            seq.feed_pos = pos  # everything before the new token is now in the cache
            seq.to_feed = [token]
            seq.tokens_drafted += 1
        self.steps += 1
        self.tokens_drafted += len(chunks)
        return chunks

    def stats(self) -> dict:
        return {
            "live_sequences": len(self.sequences),
            "free_slots": self.runner.free_slots,
            "steps": self.steps,
            "tokens_drafted": self.tokens_drafted,
        }
