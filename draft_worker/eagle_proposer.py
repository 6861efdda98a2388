"""Drafting with an EAGLE or EAGLE-3 head on the target's hidden states (duospec/engine/heads.py,
duospec/engine/eagle3.py: an EAGLE-3 head fuses the target's three-layer features with its `fc`
(`project`) before its rows read them).

Each sequence holds a KV slot of the head's one layer. Head row j reads the embedding of token j and
a feature of position j - 1: the target's own (``seq.features``, from FEATURES commands) when the
target has verified that position, else the head's prediction at row j - 1 (``pred``). The last
row's logits draft the next token and its output is the next row's feature, so the head runs ahead
of the target one token per step, like a draft model.

Rows that read a prediction are fed again with the target's feature once it arrives (greedy
requests): the rows since the first such one go in the next step's chunk, a few rows of one layer.

Sampled requests use the target's features of the prompt only and the head's own predictions after
it. What the head proposes at a position then depends on the tokens before it alone, never on when
verdicts happened to arrive, so seeded output repeats (draft_worker/proposer.py's contract). Greedy
output is the target's whatever the head proposes, so greedy requests use every verified feature.

Before the prompt's features arrive the proposer waits (the coordinator sends the prompt to the
target first); a sequence whose features have a gap (a drafter restarted mid-sequence) gets no more
drafts (exhausted): it goes on target-only, never stalls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from duospec.draft_worker.context_lookup import ContextLookup
from duospec.draft_worker.model_proposer import PREFILL_CHUNK_TOKENS, proposals_from_logits
from duospec.draft_worker.proposer import DraftMethod, DraftState, FeatureStore, Proposal, Proposer
from duospec.engine import SlotChunk, SlotsExhausted
from duospec.engine.eagle3 import Eagle3Runner
from duospec.engine.heads import EagleRunner


@dataclass
class _HeadState:
    slot: int
    fed: int = 0  # head rows [0, fed) are in the slot
    fed_true: int = 0  # rows [0, fed_true) read the target's features (the rest read predictions)
    # sampled requests: the target's features are used for positions < anchor only (the prompt's)
    anchor: int | None = None
    pred: FeatureStore = field(default_factory=FeatureStore)  # pred.rows[j]: the head's output at row j


class EagleProposer(Proposer):
    def __init__(self, runner: EagleRunner | Eagle3Runner, method: DraftMethod = DraftMethod.EAGLE, *,
                 prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS, lookup: ContextLookup | None = None,
                 stop_below: float = 0.0):
        self.runner = runner
        self.method = method
        self.lookup = lookup  # as the model drafter's (model_proposer.py): copies where the head is unsure
        self.stop_below = stop_below
        self.columns = getattr(runner, "draft_ids", None)  # EAGLE-3's draft vocabulary (None: EAGLE's whole one)
        self.max_context = runner.max_context
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.hidden_size = runner.config.hidden_size
        self.rows_fed = 0
        self.rows_refed = 0

    def open(self, seq: DraftState) -> None:
        # No prefix cache for the head: its rows depend on features as well as tokens (nothing is committed).
        anchor = None if seq.sampling.greedy else len(seq.tokens) - 1
        seq.proposer_state = _HeadState(self.runner.allocate_slot(), anchor=anchor)
        if self.lookup is not None:
            self.lookup.open(seq)

    def rewind(self, seq: DraftState, length: int) -> None:
        state: _HeadState = seq.proposer_state
        state.fed = min(state.fed, length)
        state.fed_true = min(state.fed_true, state.fed)
        state.pred.truncate(state.fed)
        if self.lookup is not None:
            self.lookup.rewind(seq, length)

    def branch(self, parent: DraftState, child: DraftState) -> bool:
        try:
            slot = self.runner.allocate_slot()
        except SlotsExhausted:
            return False
        source: _HeadState = parent.proposer_state
        shared = min(source.fed, len(child.tokens) - 1)
        self.runner.copy_prefix(source.slot, slot, shared)
        # Only predictions past the verified positions are ever read again (earlier rows read the
        # target's features), so the hedge copies the tail, not the whole history.
        keep_from = max(0, parent.committed_len - 2)
        child.proposer_state = _HeadState(slot, shared, min(source.fed_true, shared), source.anchor,
                                          source.pred.tail(keep_from, shared))
        return True

    def close(self, seq: DraftState) -> None:
        state: _HeadState | None = seq.proposer_state
        if state is not None:
            self.runner.free_slot(state.slot)
            seq.proposer_state = None
        if self.lookup is not None:
            self.lookup.close(seq)

    def _usable(self, seq: DraftState) -> int:
        """Positions [0, n) whose target features this sequence's rows may read."""
        state: _HeadState = seq.proposer_state
        known = seq.features.known
        return known if state.anchor is None else min(known, state.anchor)

    def _plan(self, seq: DraftState) -> tuple[int, int] | Proposal:
        """The rows [start, stop) to feed this step, or the proposal when there is nothing to feed."""
        state: _HeadState = seq.proposer_state
        if seq.features.broken:
            return Proposal(exhausted=True)
        usable = self._usable(seq)
        needed = seq.committed_len - 1 if state.anchor is None else state.anchor
        if usable < needed:
            return Proposal(waiting=True)
        start = state.fed
        if state.anchor is None and state.fed_true < state.fed and state.fed_true <= usable:
            start = state.fed_true  # rows that read predictions now have the target's features
        end = min(len(seq.tokens), start + self.prefill_chunk_tokens)
        stop = start + 1
        # row j needs feature j - 1: the target's (j - 1 < usable) or a prediction made in an earlier step
        while stop < end and (stop - 1 < usable or stop - 1 < state.fed):
            stop += 1
        return start, stop

    def _inputs(self, seq: DraftState, start: int, stop: int) -> torch.Tensor:
        state: _HeadState = seq.proposer_state
        usable = self._usable(seq)
        # row j reads position j - 1: the target's features below `usable`, predictions from there
        first, split = max(start, 1), min(max(start, 1, usable + 1), stop)
        parts = [torch.zeros(first - start, self.hidden_size)]
        if split > first:
            parts.append(self.runner.project(seq.features.rows_between(first - 1, split - 1)).float().cpu())
        if stop > split:
            parts.append(state.pred.rows_between(split - 1, stop - 1))
        return torch.cat(parts)

    def propose(self, seqs: list[DraftState], budgets: list[int]) -> list[Proposal]:
        plans = [self._plan(seq) for seq in seqs]
        fed = [(i, plan) for i, plan in enumerate(plans) if not isinstance(plan, Proposal)]
        proposals: list[Proposal | None] = [plan if isinstance(plan, Proposal) else None for plan in plans]
        if not fed:
            return proposals
        chunks, inputs = [], []
        for i, (start, stop) in fed:
            seq = seqs[i]
            chunks.append(SlotChunk(seq.proposer_state.slot, start, seq.tokens[start:stop]))
            inputs.append(self._inputs(seq, start, stop))
        logits, predicted = self.runner.forward_eagle(chunks, torch.cat(inputs))
        offset, ready = 0, []
        for row, (i, (start, stop)) in enumerate(fed):
            seq = seqs[i]
            state: _HeadState = seq.proposer_state
            state.pred.truncate(start)
            state.pred.write(start, predicted[offset: offset + stop - start])
            offset += stop - start
            self.rows_fed += stop - start
            self.rows_refed += max(0, min(stop, state.fed) - start)
            if start <= state.fed_true:
                state.fed_true = min(stop, self._usable(seq) + 1)
            state.fed = stop
            if stop < len(seq.tokens):  # more rows first (a long prompt, or rows that read predictions)
                proposals[i] = Proposal(prefilling=True)
                continue
            ready.append((row, i))
        if ready:
            chosen = proposals_from_logits(logits[[row for row, _ in ready]], [seqs[i] for _, i in ready],
                                           self.lookup, self.stop_below, self.columns)
            for (_, i), proposal in zip(ready, chosen):
                proposals[i] = proposal
        return proposals

    def stats(self) -> dict:
        return {"free_slots": self.runner.free_slots, "head_rows_fed": self.rows_fed,
                "head_rows_refed": self.rows_refed, **self.runner.kv_stats()}

    def cache_stats(self):
        return self.runner.cache_stats()
