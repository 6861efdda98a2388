"""The grammar backend on llguidance (MIT; Earley parser over a lazily built lexer, token masks in
tens of microseconds, rollback built in, a light wheel with no GPU stack).

Why llguidance over xgrammar: on this project's tokenizers a mask costs ~20 µs per token (median,
the bundled 4k-token vocabulary; README "Structured output"), compiling a JSON schema ~1 ms, and
its wheel is a few MB where xgrammar's pulls triton. Measured by
`tests/unit/test_structured_grammar.py::test_mask_and_compile_times_are_reported`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import llguidance
import torch

from duospec.structured.backend import Grammar, GrammarBackend, Matcher, allocate_bitmask, allowed_tokens
from duospec.structured.constraint import JSON_OPTIONS, Constraint, ConstraintError, ConstraintKind

# Work limits of one grammar (llguidance's units; the defaults written down so they are ours): the
# compile-time fuel bounds how long a pathological regex can keep a compile thread busy after the
# caller's time limit has given up on it, the per-step fuel how long one mask may take.
LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_lexer_states=250_000, max_grammar_size=500_000, max_items_in_row=2000)


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


class LLGuidanceMatcher(Matcher):
    """llguidance's LLMatcher, with end tokens kept out of it: llguidance neither validates an end token
    once its grammar has stopped nor counts a consumed one in its rollback history (rolling back one
    token after an end token undoes the token before it). So end tokens are counted here (`_ends`):
    legal where the mask admits one, and after one only end tokens are (the mask is then theirs).
    A matcher llguidance stopped (a dead end: it computed a mask where nothing can follow) refuses to
    roll back; it is then rebuilt from the grammar's start (`template`) by replaying its tokens."""

    def __init__(self, inner: llguidance.LLMatcher, end_tokens: frozenset[int], vocab_size: int,
                 template: llguidance.LLMatcher, consumed: int = 0, ends: int = 0,
                 tokens: list[int] | None = None) -> None:
        self._inner = inner
        self._template = template
        self._end_tokens = end_tokens
        self._vocab_size = vocab_size
        self._consumed = consumed  # tokens consumed, end tokens included
        self._ends = ends  # trailing end tokens consumed (never passed to llguidance)
        self._tokens = tokens if tokens is not None else []  # what llguidance consumed (no end tokens)
        self._masked_here = False  # a mask was computed at this position (llguidance's stop state is set then)

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        tokens = [int(t) for t in tokens]
        if self._ends:
            return _leading(tokens, self._end_tokens)
        first_end = next((i for i, t in enumerate(tokens) if t in self._end_tokens), len(tokens))
        n = self._inner.validate_tokens(tokens[:first_end]) if first_end else 0
        if n < first_end or first_end == len(tokens) or not self._end_legal_after(tokens[:first_end]):
            return n
        return first_end + _leading(tokens[first_end:], self._end_tokens)

    def _end_legal_after(self, prefix: list[int]) -> bool:
        """Whether the mask after the (legal, non-end) `prefix` admits an end token."""
        self._consume(prefix)
        try:
            bitmask = allocate_bitmask(1, self._vocab_size)
            self._inner.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * bitmask.element_size())
            return any(t in self._end_tokens for t in allowed_tokens(bitmask[0], self._vocab_size))
        finally:
            self._undo(len(prefix))

    def _consume(self, tokens: list[int]) -> None:
        # one at a time: llguidance's consume_tokens has refused tokens that consume_token takes
        self._masked_here = self._masked_here and not tokens
        if not all(self._inner.consume_token(t) for t in tokens):
            raise RuntimeError(f"grammar matcher refused validated tokens: {_first_line(self._inner.get_error())}")
        self._tokens.extend(tokens)

    def _undo(self, n: int) -> None:
        """Takes back the last `n` tokens llguidance consumed."""
        if not n:
            return
        self._masked_here = False
        keep = self._tokens[:-n]
        if not self._inner.rollback(n):  # stopped at a dead end: start over and replay
            self._inner, self._tokens = self._template.deep_copy(), []
            self._consume(keep)
        del self._tokens[len(keep):]

    def accept_tokens(self, tokens: Sequence[int]) -> int:
        # validate first: consuming an illegal token would leave llguidance's matcher in an error
        # state it never leaves, and the authoritative matcher must survive a bad draft
        tokens = [int(t) for t in tokens]
        n = self.validate_tokens(tokens)
        plain = 0 if self._ends else next((i for i, t in enumerate(tokens[:n]) if t in self._end_tokens), n)
        self._consume(tokens[:plain])
        self._ends += n - plain
        self._consumed += n
        return n

    def rollback(self, n: int) -> None:
        if not 0 <= n <= self._consumed:
            raise ValueError(f"rollback({n}): only {self._consumed} tokens were consumed")
        ends = min(n, self._ends)
        self._ends -= ends
        self._masked_here = self._masked_here and n == 0
        self._undo(n - ends)
        self._consumed -= n

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
            raise ValueError("bitmask must be a 2-D int32 CPU tensor [rows, ceil(V/32)]")
        target = bitmask[row]
        if self._ends:
            target.zero_()
            for t in self._end_tokens:
                target[t // 32] |= _bit(t % 32)
            return
        if not target.is_contiguous():
            raise ValueError("bitmask rows must be contiguous")
        self._inner.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
        self._masked_here = True

    def is_terminated(self) -> bool:
        return bool(self._ends) or self._inner.is_stopped()

    def is_dead_end(self) -> bool:
        # llguidance stops a matcher that can go no further (when it computes the mask there) and then
        # allows only the end tokens
        if self._ends:
            return False
        if not self._masked_here:
            self.fill_bitmask(allocate_bitmask(1, self._vocab_size), 0)
        return self._inner.is_stopped() and not self._inner.is_accepting()

    def fork(self) -> "LLGuidanceMatcher":
        return LLGuidanceMatcher(self._inner.deep_copy(), self._end_tokens, self._vocab_size, self._template,
                                 self._consumed, self._ends, list(self._tokens))

    @property
    def num_tokens(self) -> int:
        return self._consumed


def _leading(tokens: list[int], members: frozenset[int]) -> int:
    n = 0
    while n < len(tokens) and tokens[n] in members:
        n += 1
    return n


def _bit(index: int) -> int:
    """Bit `index` of an int32 word, as a Python int torch stores in int32 (bit 31 is the sign)."""
    return (1 << index) - (1 << 32) if index == 31 else 1 << index


class LLGuidanceGrammar(Grammar):
    def __init__(self, template: llguidance.LLMatcher, vocab_size: int, end_tokens: frozenset[int]) -> None:
        self._template = template  # at the start; copied for each sequence (cheaper than rebuilding)
        self.vocab_size = vocab_size
        self._end_tokens = end_tokens

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy(), self._end_tokens, self.vocab_size, self._template)


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer: llguidance.LLTokenizer, key: str) -> None:
        self._tokenizer = tokenizer
        self.key = key
        self.vocab_size = tokenizer.vocab_size
        self.end_tokens = frozenset(tokenizer.eos_tokens)

    @classmethod
    def from_pretrained(cls, path: str, end_token_ids: Sequence[int] = ()) -> "LLGuidanceBackend":
        """The tokenizer of a checkpoint directory; `end_token_ids` (the model's end tokens, all of which
        the grammar allows once it is complete) default to the tokenizer's EOS."""
        from transformers import AutoTokenizer

        return cls.from_tokenizer(AutoTokenizer.from_pretrained(path), end_token_ids, key=path)

    @classmethod
    def from_tokenizer(cls, hf_tokenizer, end_token_ids: Sequence[int] = (), *, key: str) -> "LLGuidanceBackend":
        """A loaded transformers tokenizer (fast tokenizers only: llguidance reads its tokenizer.json)."""
        import llguidance.hf

        eos = hf_tokenizer.eos_token_id
        ends = sorted({int(t) for t in end_token_ids}) or ([eos] if eos is not None else [])
        try:
            tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=ends or None)
        except (ValueError, TypeError) as exc:
            raise ConstraintError(f"the model's tokenizer cannot be used for constraints: {exc}") from None
        return cls(tokenizer, key=f"{key}|{ends}")

    def compile(self, constraint: Constraint) -> LLGuidanceGrammar:
        grammar = _grammar_text(constraint)
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer, limits=_limits())
        if error and not error.startswith("WARNING"):
            raise ConstraintError(_first_line(error))
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=_limits())
        if template.is_error():
            raise ConstraintError(_first_line(template.get_error()))
        self._check_not_empty(template, constraint)
        return LLGuidanceGrammar(template, self.vocab_size, self.end_tokens)

    def _check_not_empty(self, template: llguidance.LLMatcher, constraint: Constraint) -> None:
        """A constraint that admits no text at all (a regex like `[^\\s\\S]`) is the user's mistake,
        found now rather than as a generation that can only end at once."""
        bitmask = allocate_bitmask(1, self.vocab_size)
        LLGuidanceMatcher(template, self.end_tokens, self.vocab_size, template).fill_bitmask(bitmask, 0)
        legal = set(allowed_tokens(bitmask[0], self.vocab_size))
        if not legal - self.end_tokens and not template.is_accepting():
            raise ConstraintError(f"this {constraint.kind.value} matches no text")


def _grammar_text(constraint: Constraint) -> str:
    try:
        if constraint.kind is ConstraintKind.JSON_SCHEMA:
            return llguidance.LLMatcher.grammar_from_json_schema(json.loads(constraint.text), defaults=JSON_OPTIONS)
        if constraint.kind is ConstraintKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if constraint.kind is ConstraintKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(constraint.text)
        return llguidance.LLMatcher.grammar_from_lark(constraint.text)
    except (ValueError, TypeError) as exc:
        raise ConstraintError(_first_line(str(exc))) from None


def _first_line(message: str) -> str:
    """llguidance's errors carry a parser dump after the first line; users need the first line and the
    `error: ...` lines of a regex parser (which say what is wrong where the first line says where)."""
    lines = [line.strip() for line in message.strip().splitlines()]
    if not lines:
        return "invalid constraint"
    details = [line for line in lines[1:] if line.startswith("error:")]
    return " ".join([lines[0], *details])[:500]
