"""Drafting with a model: a small draft checkpoint, or the target's own first K layers.

One token per step for every drafting sequence, in one ragged batched forward (the drafter's
`step` is called again at once while any sequence is below its bound). Each sequence holds a KV slot;
`fed` counts the positions of `tokens` already in it, so a step feeds only what is new (after a
RESET: the committed tail; otherwise the previously drafted token).

Prefix cache (a paged runner): a new sequence takes what it can of its verified prompt from the cache
(`match_prefix`, under its `cache_salt`), and after each step the positions both fed and verified
are committed to it — never a drafted one.

Hedges (draft_worker/hedges.py): a branch gets a free slot holding a copy of the parent's KV prefix;
each proposal names the draft's next-best tokens (by logit) as the likeliest corrections.

Sampling: the proposer samples from exactly the q it sends (`qcodec.draft_sample` decodes its own
16-bit q before sampling), keyed by (seed, position, DRAFT), so re-drafting a position after an abort
draws the same token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from duospec.draft_worker.context_lookup import ContextLookup
from duospec.draft_worker.proposer import DraftMethod, DraftState, Proposal, Proposer
from duospec.engine import ModelRunner, SlotChunk, SlotsExhausted
from duospec.qcodec import draft_sample
from duospec.structured.backend import apply_bitmask


ALTERNATIVES = 2  # next-best tokens named per drafted position (hedge keys)


def proposals_from_logits(logits: torch.Tensor, seqs: list[DraftState], lookup: ContextLookup | None = None,
                          stop_below: float = 0.0, columns: torch.Tensor | None = None) -> list[Proposal]:
    """One drafted token per row of ``logits [n, V]`` for ``seqs[i]`` at its next position — greedy:
    the argmax, or where the model is unsure what `lookup` copies from the verified text
    (draft_worker/context_lookup.py); sampled: a draw from q (`draft_sample`) — with the draft's
    next-best tokens as hedge keys. The logits may stay on the runner's device: only token ids come
    back from it, plus the rows of sampled sequences (their q is encoded on the host). A sequence with
    a grammar mask drafts from its masked logits: its q is the masked q, and that is what it sends.

    `stop_below`: a greedy chain ends (EXHAUSTED: nothing more until the verdict) after a token the model
    gave less than this probability, since what follows it is likelier wasted than verified. Greedy
    only: a sampled request's chunk ends must follow from its tokens alone (draft_worker/proposer.py),
    and a probability can move across the threshold with the batch's shape.

    `columns`: the draft's trimmed vocabulary (ascending ids; every other logit is -inf): the argmax,
    runners-up and confidence are found among those columns only (on the SmolLM2 draft's 8,192 of
    49,152 that is ~40 µs a row instead of ~260); a sampled row still draws from the whole row."""
    masked = [(row, seq.grammar_mask) for row, seq in enumerate(seqs) if seq.grammar_mask is not None]
    if masked:
        raw, logits = logits, logits.clone()  # the runner's output buffer is not ours to change
        for row, bitmask in masked:
            apply_bitmask(logits, [row], bitmask)
        rows = [row for row, _ in masked]
        # a draft vocabulary (EAGLE-3) may hold no legal token: that row drafts unmasked (the target decides)
        for row, alive in zip(rows, torch.isfinite(logits[rows]).any(dim=-1).tolist()):
            if not alive:
                logits[row] = raw[row]
    scored = logits if columns is None else logits.index_select(1, columns)
    top = torch.topk(scored, min(ALTERNATIVES + 1, scored.shape[-1]), dim=-1)
    picks = torch.cat([scored.argmax(dim=-1, keepdim=True), top.indices], dim=1)
    picks = (picks if columns is None else columns[picks]).tolist()  # one copy off the device
    # a masked row's runners-up may be illegal (-inf): never a hedge key
    legal = torch.isfinite(top.values).tolist() if masked else None
    sampled = [i for i, seq in enumerate(seqs) if not seq.sampling.greedy]
    host = dict(zip(sampled, logits[sampled].cpu())) if sampled else {}
    confidence: dict[int, float] = {}  # greedy unmasked row -> the model's probability of its argmax
    if lookup is not None or stop_below > 0:
        judged = [row for row, seq in enumerate(seqs) if seq.sampling.greedy and seq.grammar_mask is None]
        if judged:
            best = (top.values[judged, 0] - torch.logsumexp(scored[judged], dim=-1)).exp()
            confidence = dict(zip(judged, best.tolist()))
    copies = lookup.copies(seqs, confidence) if lookup is not None else {}
    proposals = []
    for row, seq in enumerate(seqs):
        token, q = draft_sample(host[row], seq.sampling, seq.next_pos) if row in host else (picks[row][0], None)
        token = copies.get(row, token)  # a copy leaves the model's argmax first among the next-best
        others = [t for i, t in enumerate(picks[row][1:]) if t != token and (legal is None or legal[row][i])]
        others = others[:ALTERNATIVES]
        ends = row not in copies and confidence.get(row, 1.0) < stop_below
        proposals.append(Proposal([token], [q] if q is not None else [], exhausted=ends, alternatives=[others]))
    return proposals


@dataclass
class _SlotState:
    slot: int
    fed: int = 0  # tokens[:fed] are in the slot's KV cache


PREFILL_CHUNK_TOKENS = 512  # models[].prefill_chunk_tokens' default
# draft.stop_confidence's default for a drafter on the CPU, where it shares cores with the target: on 2
# cores the SmolLM2 pair's pearl went 1.70x -> 1.85x `off` on held-out code in-process (vanilla level).
# On an accelerator drafting past an unsure token costs the target nothing, and drafts ready when the
# verdict accepts it keep the overlap: 0 there.
CPU_STOP_CONFIDENCE = 0.4


class ModelProposer(Proposer):
    def __init__(self, runner: ModelRunner, method: DraftMethod = DraftMethod.MODEL, *,
                 prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS, lookup: ContextLookup | None = None,
                 stop_below: float = 0.0):
        self.runner = runner
        self.method = method
        self.lookup = lookup  # copies from the verified text where the model is unsure (None: off)
        self.stop_below = stop_below  # a greedy chain ends after a token less likely than this (proposals_from_logits)
        self.columns = getattr(runner, "draft_ids", None)  # a trimmed draft vocabulary (None: the whole one)
        self.max_context = runner.max_context
        # A long prompt is read this many tokens per step, so the other sequences keep drafting.
        self.prefill_chunk_tokens = prefill_chunk_tokens

    def open(self, seq: DraftState) -> None:
        slot = self.runner.allocate_slot(seq.cache_salt)
        verified = seq.tokens[: seq.committed_len]
        seq.proposer_state = _SlotState(slot, self.runner.match_prefix(slot, 0, verified) if verified else 0)
        if self.lookup is not None:
            self.lookup.open(seq)

    def rewind(self, seq: DraftState, length: int) -> None:
        state: _SlotState = seq.proposer_state
        state.fed = min(state.fed, length)  # the next forward starts there and overwrites the rest
        if self.lookup is not None:
            self.lookup.rewind(seq, length)

    def branch(self, parent: DraftState, child: DraftState) -> bool:
        try:
            slot = self.runner.allocate_slot()
        except SlotsExhausted:
            return False
        source: _SlotState = parent.proposer_state
        shared = min(source.fed, len(child.tokens) - 1)  # the positions before the branch token
        self.runner.copy_prefix(source.slot, slot, shared)
        child.proposer_state = _SlotState(slot, shared)
        return True

    def close(self, seq: DraftState) -> None:
        state: _SlotState | None = seq.proposer_state
        if state is not None:
            self.runner.free_slot(state.slot)
            seq.proposer_state = None
        if self.lookup is not None:
            self.lookup.close(seq)

    def propose(self, seqs: list[DraftState], budgets: list[int]) -> list[Proposal]:
        states: list[_SlotState] = [seq.proposer_state for seq in seqs]
        ends = [min(len(seq.tokens), state.fed + self.prefill_chunk_tokens) for seq, state in zip(seqs, states)]
        logits = self.runner.forward_last(
            [SlotChunk(state.slot, state.fed, seq.tokens[state.fed:end]) for seq, state, end in zip(seqs, states, ends)],
            to_cpu=False,
        )
        proposals = [Proposal(prefilling=True) for _ in seqs]
        ready = []
        for row, (seq, state, end) in enumerate(zip(seqs, states, ends)):
            state.fed = end  # everything before the new token, once the whole prompt is in
            self.runner.commit(state.slot, min(state.fed, seq.committed_len))
            if end == len(seq.tokens):
                ready.append(row)
        if ready:
            chosen = proposals_from_logits(logits[ready], [seqs[r] for r in ready], self.lookup, self.stop_below,
                                           self.columns)
            for row, proposal in zip(ready, chosen):
                proposals[row] = proposal
        return proposals

    def stats(self) -> dict:
        lookup = self.lookup.stats() if self.lookup is not None else {}
        return {"free_slots": self.runner.free_slots, **self.runner.kv_stats(), **lookup}

    def cache_stats(self):
        return self.runner.cache_stats()
