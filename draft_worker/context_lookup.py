"""Copying from the sequence's own verified text where the draft model is unsure.

A small draft model is poor at in-context copying: SmolLM2-135M repeats names, phrases and code from
earlier in its answer ("the Eiffel Tower ... the Eiffel Tower", a variable name, a docstring's words),
and the 21 M-parameter draft guesses something else about half the time. Prompt lookup gets those
tokens right but little else. So a model drafter consults both, per drafted token of a greedy request:
when the text so far ends with a bigram that occurred before in the verified text (prompt + verified
output), and the model's top probability is below MAX_CONFIDENCE, the token that followed that
earlier occurrence is drafted instead of the model's argmax (which becomes the first next-best token,
so trees and hedges still branch on it). Of several earlier occurrences, the one whose context matches
furthest back wins (at most MAX_DEPTH tokens), then the latest.

Measured teacher-forced (greedy, 4 drafts, SmolLM2 with the shipped draft, 48 held-out prompts per
set; benchmarks/acceptance.py --context-lookup): see docs/benchmarks.md.

Exactness: greedy output is the target's whatever is drafted. Sampled requests keep the model's own
draws (their q must be what the token was drawn from), and so do rows under a grammar mask.

The index: per sequence, every verified position p >= 2 keyed by the bigram before it. It only ever
covers verified positions, grows when more are verified, and is cut back when an abort replaces
positions it covers. Hedges (branches of the same sequence, draft_worker/hedges.py) share it: a hedge's
tokens equal the sequence's at every position it counts as verified (before its branch), and an abort
drops every hedge, so a hedge may extend the index too, but only the sequence itself cuts or frees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from duospec.draft_worker.proposer import DraftState

MIN_MATCH = 2  # a bigram: a single repeated token predicts its successor too rarely (measured)
MAX_DEPTH = 8  # context compared back from the end when several earlier occurrences match
MAX_CONFIDENCE = 0.5  # the model's top probability below which an earlier occurrence wins
MAX_CANDIDATES = 32  # the latest occurrences of a bigram compared (a common bigram occurs hundreds of times)


@dataclass
class _Index:
    owner: DraftState  # the main line; only it cuts the index back or frees it, never one of its hedges
    positions: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # bigram -> positions after it
    indexed: int = 0  # positions [MIN_MATCH, indexed) are in `positions`

    def extend(self, tokens: list[int], upto: int) -> None:
        for pos in range(max(self.indexed, MIN_MATCH), upto):
            self.positions.setdefault((tokens[pos - 2], tokens[pos - 1]), []).append(pos)
        self.indexed = max(self.indexed, upto)

    def truncate(self, tokens: list[int], length: int) -> None:
        for pos in range(self.indexed - 1, max(length, MIN_MATCH) - 1, -1):
            key = (tokens[pos - 2], tokens[pos - 1])
            found = self.positions[key]
            found.pop()  # positions are appended in order, so `pos` is the last
            if not found:
                del self.positions[key]
        self.indexed = min(self.indexed, length)


class ContextLookup:
    """The per-sequence indexes of one drafter (called from its one thread)."""

    def __init__(self) -> None:
        self._indexes: dict[int, _Index] = {}
        self.consulted = 0  # greedy rows where the model was unsure
        self.used = 0  # of those, rows where an earlier occurrence's continuation replaced the model's argmax

    def open(self, seq: DraftState) -> None:
        self._indexes[seq.seq_id] = _Index(seq)

    def rewind(self, seq: DraftState, length: int) -> None:
        """`seq.tokens[length:]` is about to be replaced (called before the tokens change)."""
        index = self._indexes.get(seq.seq_id)
        if index is not None and index.owner is seq and length < index.indexed:
            index.truncate(seq.tokens, length)

    def close(self, seq: DraftState) -> None:
        index = self._indexes.get(seq.seq_id)
        if index is not None and index.owner is seq:
            del self._indexes[seq.seq_id]

    def suggest(self, seq: DraftState) -> int | None:
        """The token that followed the latest best-matching earlier occurrence of the text's last
        bigram in the verified text, or None."""
        index = self._indexes.get(seq.seq_id)
        tokens = seq.tokens
        if index is None or len(tokens) < MIN_MATCH:
            return None
        index.extend(tokens, min(seq.committed_len, len(tokens)))
        found = index.positions.get((tokens[-2], tokens[-1]))
        if not found:
            return None
        end = len(tokens)
        best_pos, best_depth = -1, 0
        for pos in reversed(found[-MAX_CANDIDATES:]):
            if pos >= seq.committed_len:  # a hedge's verified prefix may be shorter than the index
                continue
            depth = MIN_MATCH
            while depth < MAX_DEPTH and depth < pos and tokens[pos - 1 - depth] == tokens[end - 1 - depth]:
                depth += 1
            if depth > best_depth:
                best_pos, best_depth = pos, depth
                if depth == MAX_DEPTH:
                    break
        return tokens[best_pos] if best_pos >= 0 else None

    def copies(self, seqs: list[DraftState], confidence: dict[int, float]) -> dict[int, int]:
        """row -> the token copied there instead of the model's argmax, for the rows of `confidence`
        (greedy, unmasked: row -> the model's top probability) below MAX_CONFIDENCE whose text's last
        bigram occurred before."""
        unsure = [row for row, p in confidence.items() if p < MAX_CONFIDENCE]
        self.consulted += len(unsure)
        copies = {row: token for row in unsure if (token := self.suggest(seqs[row])) is not None}
        self.used += len(copies)
        return copies

    def stats(self) -> dict:
        return {"lookup_consulted": self.consulted, "lookup_used": self.used}
