"""Prompt lookup for empty rounds: drafts the coordinator finds in a sequence's own committed text.

Right after a rejection pearl may send a greedy sequence to a free target with no draft at all (an
empty round, Scheduler._may_verify_without_drafts): the restarted drafter has nothing yet, and the
target's bonus token is its next token; the same goes while the goodput guard keeps the drafter
paused. Such a round commits one token for a whole verify forward.
Before it goes, the coordinator looks for the sequence's last few tokens earlier in its own text
(prompt + output) and, where they occurred, proposes what followed them then (prompt lookup
decoding); the round verifies those tokens as drafts. On repetitive text — code, edits of a given
document, structured output — they are often right, and the round commits several tokens instead of
one for little more than one token's verify cost (the scheduler sizes the proposal with the verify
cost model and the lookups' own measured acceptance).

Exact by construction: the tokens go through the greedy verify rule like any draft, so the
committed tokens are the target's argmax whatever is proposed. They are not the drafter's: a
rejected lookup token never restarts the drafter, and its chunks are checked against every token the
round decided (Sequence.apply_verdict, Sequence.decided_prefix).

Cheap: one dict entry per committed token and n-gram length (~400 bytes per token, unlike the n-gram
drafter's trie of every context up to 8 tokens), indexed lazily when a lookup is made and over the
last `LOOKUP_WINDOW` tokens of a long text only, and one dict lookup per proposal. The proposal is
the text that followed the latest earlier occurrence of the longest matching suffix (`max_ngram`
down to `min_ngram` tokens), copied as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field


# Only the last this many tokens of a sequence's text are searched: a long prompt's first lookup then
# indexes at most 8,192 positions (~20 ms of the coordinator's loop on a slow core; the whole of a
# 128k-token prompt would take ~0.3 s and ~50 MB), and recent text is where repeats usually are.
LOOKUP_WINDOW = 8192


@dataclass
class TextLookup:
    """The n-gram index of one sequence's committed tokens (which only ever grow)."""

    min_ngram: int = 2
    max_ngram: int = 4
    window: int = LOOKUP_WINDOW
    # n-gram (as a tuple) -> where the token that followed its latest occurrence sits
    _after: dict[tuple[int, ...], int] = field(default_factory=dict)
    _indexed: int = 0  # every n-gram ending before this position is in _after

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` seen before (at least `min_ngram` long), or none."""
        if k <= 0:
            return []
        self._index(tokens)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            start = self._after.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + k]
        return []

    def _index(self, tokens: list[int]) -> None:
        # The n-grams ending at position end - 1 are indexed once the token after them (at `end`)
        # exists: the current suffix then finds its earlier occurrences only, never itself.
        for end in range(max(self._indexed, 1, len(tokens) - self.window), len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._after[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, len(tokens))
