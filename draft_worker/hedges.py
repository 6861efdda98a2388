"""The speculation cache, drafter side: hedges drafted in the drafter's spare steps (docs/design.md#beyond-one-chain).

A verdict says "k of the drafts were accepted, then the target put token c at position b" (a
correction, or a bonus the main line did not guess). PEARL alone throws the drafter's work away on
every such rejection and the target waits while the drafter catches up. So when no main line may
draft (every sequence is at its lookahead bound, waiting for a verdict), the drafter spends its steps
on hedges: for the first unverified positions b of a sequence it takes the proposer's next-best
tokens c there (`Proposal.alternatives`) and drafts a short continuation after each, in a branch of
its own (`Proposer.branch`: for a model, a slot holding a copy of the KV prefix). Hedge chunks go to
the coordinator tagged with their key (b, c) and the epoch. When a verdict hits a key the coordinator
sends the continuation to the target at once and RESETs the drafter with ``adopt`` = that key; the
branch becomes the sequence's main line, KV included (`HedgeBook.take`). Every other RESET drops the
sequence's hedges, and an ADVANCE drops those at positions it decided.

Exactness: a hedge is what the proposer drafts for the sequence's tokens before b followed by c —
exactly what a RESET to that outcome would draft (the same tokens, the same q: sampling is keyed by
position) — so a hit changes when drafts arrive, never which. The verify rule does the rest.

Which keys: offset i = b - committed_len and alternative rank j in the order of i + 2j (a rejection at
offset i has probability ~ α^i (1 - α); a second alternative is rarer than a first), at most the
sequence's ``max_hedges`` (the coordinator's setting), each drafted at most HEDGE_DEPTH tokens deep
(what the next verify takes at once). Hedges ride along in the main lines' batched forward: each
step drafts one more token of every main line below its bound and of every hedge still growing (a few
more rows in one forward — on a GPU, and in oneDNN's CPU GEMM, about free — where drafting hedges
only in idle steps found almost none ready: in PEARL the drafter is rarely idle). A new sequence that
finds no free slot evicts them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from duospec.draft_worker.proposer import DraftState, Proposer

HEDGE_DEPTH = 4  # continuation tokens drafted per hedge (the next verify's chunk)
MAX_OFFSET = 8  # hedge keys lie at most this many positions past the first unverified one

Key = tuple[int, int]  # (position, token)


class HedgeBook:
    """Every sequence's hedges: branches of its main line keyed by (position, token)."""

    def __init__(self, proposer: Proposer):
        self.proposer = proposer
        self._hedges: dict[int, dict[Key, DraftState]] = {}  # seq_id -> key -> the branch
        self._unavailable: dict[int, set[Key]] = {}  # keys the proposer could not branch (no room)
        self.created = 0
        self.adopted = 0
        self.tokens_drafted = 0

    # -- what to hedge ------------------------------------------------------------------------
    @staticmethod
    def _wanted(seq: DraftState) -> list[Key]:
        """The sequence's hedge keys, likeliest first."""
        if seq.max_hedges <= 0:
            return []
        ranked = []
        for offset in range(MAX_OFFSET):
            pos = seq.committed_len + offset
            if pos >= len(seq.tokens):
                break
            for rank, token in enumerate(seq.alternatives.get(pos, ())):
                ranked.append((offset + 2 * rank, pos, token))
        ranked.sort()
        return [(pos, token) for _, pos, token in ranked[: seq.max_hedges]]

    def _missing(self, seq: DraftState) -> list[Key]:
        held = self._hedges.get(seq.seq_id, {})
        unavailable = self._unavailable.get(seq.seq_id, ())
        return [key for key in self._wanted(seq) if key not in held and key not in unavailable]

    @staticmethod
    def _may_grow(hedge: DraftState, limit: int | None) -> bool:
        end = hedge.draft_until if limit is None else min(hedge.draft_until, limit)
        return not hedge.exhausted and hedge.next_pos < end

    def has_work(self, seqs: Iterable[DraftState]) -> bool:
        limit = self.proposer.max_context
        for seq in seqs:
            if self._missing(seq) or any(self._may_grow(h, limit) for h in self._hedges.get(seq.seq_id, {}).values()):
                return True
        return False

    # -- drafting -----------------------------------------------------------------------------
    def growing(self, seqs: Iterable[DraftState]) -> list[tuple[Key, DraftState, int]]:
        """(key, hedge, budget) for every hedge that may grow this step, creating missing ones first."""
        limit = self.proposer.max_context
        out = []
        for seq in seqs:
            for key in self._missing(seq):
                self._create(seq, key)
            for key, hedge in self._hedges.get(seq.seq_id, {}).items():
                if self._may_grow(hedge, limit):
                    end = hedge.draft_until if limit is None else min(hedge.draft_until, limit)
                    out.append((key, hedge, end - hedge.next_pos))
        return out

    def grew(self, hedge: DraftState, proposal, budget: int) -> list[int]:
        """Applies a hedge's proposal; returns the tokens it got."""
        tokens = proposal.tokens[:budget]
        extend(hedge, tokens, proposal.alternatives)
        hedge.exhausted = proposal.exhausted or not tokens
        self.tokens_drafted += len(tokens)
        return tokens

    def _create(self, seq: DraftState, key: Key) -> None:
        pos, token = key
        limit = self.proposer.max_context
        if limit is not None and pos + 1 >= limit:
            self._unavailable.setdefault(seq.seq_id, set()).add(key)
            return
        hedge = dataclasses.replace(
            seq, tokens=seq.tokens[:pos] + [token], committed_len=min(seq.committed_len, pos),
            draft_until=pos + 1 + HEDGE_DEPTH, exhausted=False, tokens_drafted=0, proposer_state=None,
            max_hedges=0, alternatives={}, forced=[])
        if not self.proposer.branch(seq, hedge):
            self._unavailable.setdefault(seq.seq_id, set()).add(key)
            return
        self._hedges.setdefault(seq.seq_id, {})[key] = hedge
        self.created += 1

    # -- verdict outcomes ---------------------------------------------------------------------
    def take(self, seq_id: int, key: Key) -> DraftState | None:
        """Removes and returns the hedge for `key` (the verdict hit it); the caller owns its state."""
        return self._hedges.get(seq_id, {}).pop(key, None)

    def decided(self, seq: DraftState) -> None:
        """`seq.committed_len` grew: positions before it are decided, their hedges are useless."""
        for key in [k for k in self._hedges.get(seq.seq_id, {}) if k[0] < seq.committed_len]:
            self.proposer.close(self._hedges[seq.seq_id].pop(key))
        self._unavailable.pop(seq.seq_id, None)  # slots may have freed since: try again

    def drop(self, seq_id: int) -> None:
        for hedge in self._hedges.pop(seq_id, {}).values():
            self.proposer.close(hedge)
        self._unavailable.pop(seq_id, None)

    def drop_all(self) -> None:
        for seq_id in list(self._hedges):
            self.drop(seq_id)
        self._unavailable.clear()

    def live(self) -> int:
        return sum(len(h) for h in self._hedges.values())

    def stats(self) -> dict:
        return {"hedges_live": self.live(), "hedges_created": self.created, "hedges_adopted": self.adopted,
                "hedge_tokens_drafted": self.tokens_drafted}


def extend(seq: DraftState, tokens: list[int], alternatives: list[list[int]]) -> None:
    """Appends proposed tokens to a sequence (main line or hedge) with the proposer's alternatives."""
    start = len(seq.tokens)
    seq.tokens.extend(tokens)
    for i, alts in enumerate(alternatives[: len(tokens)]):
        if alts:
            seq.alternatives[start + i] = list(alts)


def forget_alternatives(seq: DraftState, below: int | None = None, from_pos: int | None = None) -> None:
    """Drops the recorded alternatives before `below` (decided) or from `from_pos` on (rewound)."""
    seq.alternatives = {pos: alts for pos, alts in seq.alternatives.items()
                        if (below is None or pos >= below) and (from_pos is None or pos < from_pos)}
