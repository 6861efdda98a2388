"""The drafter's side of constrained requests (docs/design.md, "Exactness": constrained requests).

Per constrained sequence a matcher follows the sequence's tokens, verified and drafted, so that:
- a model proposer draws from q masked by the grammar, and sends that masked q (`mask`; a hedge of the
  speculation cache likewise, through a copy of its parent's matcher: `hedge_mask`);
- where the grammar allows exactly one token, that token is drafted without a model step (`forced`),
  with q the point mass on it: the target's mask there holds the same single token (same grammar,
  same tokenizer, same tokens before it), so it is accepted, and still verified. Its chunk says so
  (DraftChunk.forced): such tokens count neither toward the lookahead nor toward the coordinator's
  draft cap, so a schema's forced keys and punctuation ride along with the drafts around them;
- a greedy proposal (any proposer: n-gram, heads) is cut before its first illegal token
  (`legal_prefix`): a greedy draft is a point mass, so a shorter one is as exact as the long one.
  A sampled draft is never cut: that would bias the recovered token.
None of this is needed for exactness: the target masks p and verifies every draft. It is what keeps
drafts inside JSON legal, so that they are accepted. A matcher that cannot follow (a constraint that
does not compile here, tokens it forbids) leaves its sequence drafting unmasked meanwhile.
"""

from __future__ import annotations

import logging

import torch

from duospec.draft_worker.proposer import DraftState
from duospec.internal.constraint_wire import constraint_from_proto
from duospec.internal.v1 import pearl_pb2 as pb
from duospec.structured import ConstraintError, SequenceGrammars
from duospec.structured.backend import allocate_bitmask, allowed_tokens
from duospec.structured.manager import INLINE_COMPILE_S, WorkerCompilers

log = logging.getLogger("duospec.draft")


class DraftGrammars:
    def __init__(self, tokenizer_path: str | None, factory=None) -> None:
        self.compilers = WorkerCompilers(tokenizer_path, factory)
        self.matchers = SequenceGrammars()
        self._vocab: dict[int, int] = {}  # seq_id -> its grammar's mask width
        self._stable: dict[int, int] = {}  # seq_id -> positions before this are what its matcher followed
        self._ends: dict[int, frozenset[int]] = {}
        self._pending: dict[int, pb.GrammarConstraint] = {}  # seq_id -> its constraint, compiling meanwhile
        self.forced_tokens = 0  # drafted without a model step
        self.cut_tokens = 0  # greedy proposals' tokens dropped as illegal
        self.unmasked_steps = 0  # steps a constrained sequence drafted unmasked (its tokens left the grammar)

    def open(self, seq: DraftState, constraint: pb.GrammarConstraint, wait_s: float = INLINE_COMPILE_S) -> None:
        """Follow `seq` under `constraint`; until its compile is done (awaited `wait_s` at most), the
        sequence drafts unmasked."""
        parsed = constraint_from_proto(constraint)
        if parsed is None:
            return
        try:
            compiler = self.compilers.get(constraint.end_token_ids)
            if compiler.prepare(parsed, wait_s) is not None:  # compiling in the background: unmasked drafts meanwhile
                self._pending[seq.seq_id] = constraint
                return
            grammar = compiler.compile(parsed)
        except ConstraintError as exc:  # the coordinator compiled it; here it only costs acceptance
            log.warning("seq %d: drafting without the constraint's mask: %s", seq.seq_id, exc)
            return
        self.matchers.open(seq.seq_id, grammar, constraint.output_start)
        self._vocab[seq.seq_id] = grammar.vocab_size
        self._ends[seq.seq_id] = frozenset(constraint.end_token_ids)
        self._stable[seq.seq_id] = 0

    def release(self, seq_id: int) -> None:
        self.matchers.release(seq_id)
        for table in (self._vocab, self._stable, self._ends, self._pending):
            table.pop(seq_id, None)

    def changed(self, seq_id: int, from_pos: int) -> None:
        """The sequence's tokens from `from_pos` on were replaced (a RESET)."""
        if seq_id in self._stable:
            self._stable[seq_id] = min(self._stable[seq_id], from_pos)

    def _follow(self, seq: DraftState) -> bool:
        """Bring the matcher to the end of `seq.tokens`; False where it cannot. That happens when a RESET
        keeps drafts of a hedge (hedges draft unmasked) that the grammar forbids: the matcher then
        holds the legal part, the sequence drafts unmasked (the target rejects the illegal token and
        corrects), and the RESET that removes the token lets it follow again. A grammar still compiling
        opens here once it is ready, and follows the tokens drafted meanwhile."""
        if seq.seq_id in self._pending:
            self.open(seq, self._pending.pop(seq.seq_id), wait_s=0.0)
        if seq.seq_id not in self._stable:
            return False
        if not self.matchers.follow(seq.seq_id, seq.tokens, self._stable[seq.seq_id]):
            self.unmasked_steps += 1
            return False
        self._stable[seq.seq_id] = len(seq.tokens)
        return True

    def mask(self, seq: DraftState) -> torch.Tensor | None:
        """``[1, ceil(V/32)]`` int32: the legal next tokens after `seq.tokens`; None: unconstrained."""
        if not self._follow(seq):
            return None
        bitmask = allocate_bitmask(1, self._vocab[seq.seq_id])
        self.matchers.fill(seq.seq_id, bitmask)
        return bitmask if bool((bitmask != 0).any()) else None  # a dead end is the target's to report

    def forced(self, seq: DraftState, budget: int) -> tuple[list[int], torch.Tensor | None]:
        """The tokens the grammar forces after `seq.tokens`, one after another, at most `budget` (none
        past an end token), which the matcher consumes (the drafter appends them to the sequence); and
        the mask after them (`mask`'s, for the proposer), None when unconstrained."""
        out: list[int] = []
        bitmask = self.mask(seq)
        while bitmask is not None and len(out) < budget:
            legal = allowed_tokens(bitmask[0], self._vocab[seq.seq_id])
            if len(legal) != 1:
                break
            out.append(legal[0])
            bitmask = self._mask_after(seq, out)
            if legal[0] in self._ends[seq.seq_id]:
                break
        self.forced_tokens += len(out)
        return out, bitmask

    def ended(self, seq: DraftState) -> bool:
        """Whether the grammar is done after `seq.tokens` (an end token accepted): nothing past it
        can be accepted, so the sequence drafts no further."""
        return self._follow(seq) and self.matchers.matcher(seq.seq_id).is_terminated()

    def _mask_after(self, seq: DraftState, extra: list[int]) -> torch.Tensor | None:
        if not self.matchers.follow(seq.seq_id, [*seq.tokens, *extra], len(seq.tokens) + len(extra) - 1):
            return None
        bitmask = allocate_bitmask(1, self._vocab[seq.seq_id])
        self.matchers.fill(seq.seq_id, bitmask)
        return bitmask if bool((bitmask != 0).any()) else None

    def hedge_mask(self, hedge: DraftState) -> torch.Tensor | None:
        """The mask after a hedge's tokens (its parent's prefix, its key token, its drafts): a copy of
        the parent's matcher follows them, so hedges draft legal tokens too. None: unconstrained, or
        the hedge's tokens leave the grammar (its key is a draft's runner-up: possibly illegal)."""
        if hedge.seq_id not in self._stable:
            return None
        matcher = self.matchers.fork_following(hedge.seq_id, hedge.tokens)
        if matcher is None:
            return None
        bitmask = allocate_bitmask(1, self._vocab[hedge.seq_id])
        matcher.fill_bitmask(bitmask, 0)
        return bitmask if bool((bitmask != 0).any()) else None

    def legal_prefix(self, seq: DraftState, tokens: list[int]) -> int:
        """How many of `tokens` (proposed after `seq.tokens`) are legal in turn; all when unconstrained."""
        if not tokens or not self._follow(seq):
            return len(tokens)
        n = self.matchers.matcher(seq.seq_id).validate_tokens(tokens)
        self.cut_tokens += len(tokens) - n
        return n

    def work(self) -> tuple[float, int, int]:
        """Cumulative (mask seconds, mask rows, forced tokens): what the loop reports (GrammarWork)."""
        return self.matchers.mask_seconds, self.matchers.mask_rows, self.forced_tokens

    def stats(self) -> dict:
        return {"grammar_forced_tokens": self.forced_tokens, "grammar_cut_tokens": self.cut_tokens,
                "grammar_unmasked_steps": self.unmasked_steps,
                "grammar_mask_rows": self.matchers.mask_rows, "grammar_mask_seconds": self.matchers.mask_seconds,
                **self.compilers.stats()}
