"""The grammar interface the rest of duospec sees: a backend compiles a `Constraint` for one
tokenizer into a `Grammar`; a `Matcher` follows one sequence through it.

One implementation per library lives beside this file (`llguidance_backend.py`); the workers and the
verify rule never import a library. Masks are int32 bitmasks ``[rows, ceil(V / 32)]`` (bit ``t % 32``
of word ``t // 32`` set: token t is legal), the layout grammar libraries fill natively; `apply_bitmask`
turns rows of them into ``-inf`` logits where the logits live.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from duospec.structured.constraint import Constraint


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """``[rows, ceil(V/32)]`` int32, every token allowed (a row nobody fills leaves logits as they are)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def bitmask_to_bool(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """``[rows, W]`` int32 → ``[rows, width]`` bool (True: legal); ids past the mask's 32·W are illegal."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().reshape(bitmask.shape[0], -1)
    if allowed.shape[1] >= width:
        return allowed[:, :width]
    pad = torch.zeros(bitmask.shape[0], width - allowed.shape[1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
    """Set ``logits[rows[i], t] = -inf`` wherever bit t of ``bitmask[i]`` is clear, in place, on the
    logits' device. Masking the logits is masking p before temperature, top-k and top-p: the softmax
    of the kept logits is p renormalised over the legal tokens, at any temperature."""
    if not len(rows):
        return
    index = torch.as_tensor(list(rows), dtype=torch.long, device=logits.device)
    allowed = bitmask_to_bool(bitmask.to(logits.device), logits.shape[1])
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """The legal token ids of one bitmask row (tests and the drafter's forced-token check)."""
    return torch.nonzero(bitmask_to_bool(bitmask_row[None], vocab_size)[0]).flatten().tolist()


class Matcher(abc.ABC):
    """One sequence's position in a grammar. Only legal tokens are ever consumed: callers check
    with `validate_tokens` first, so a matcher never enters an error state."""

    @abc.abstractmethod
    def validate_tokens(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` are legal in turn from here (nothing is consumed)."""

    @abc.abstractmethod
    def accept_tokens(self, tokens: Sequence[int]) -> int:
        """Consume the legal prefix of `tokens`; returns its length (the rest are left unconsumed)."""

    @abc.abstractmethod
    def rollback(self, n: int) -> None:
        """Undo the last `n` consumed tokens."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the legal next tokens into ``bitmask[row]`` (int32 ``[rows, ceil(V/32)]``, on the CPU)."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and admits nothing more but an end token."""

    @abc.abstractmethod
    def is_dead_end(self) -> bool:
        """The text so far is not complete and nothing can complete it: no token is legal, or only an
        end token is (a library may offer that as its way out). The target alone stops here."""

    @abc.abstractmethod
    def fork(self) -> "Matcher":
        """An independent copy in the same state (a drafter's speculative matcher)."""

    @property
    @abc.abstractmethod
    def num_tokens(self) -> int:
        """Tokens consumed since the start."""

    def forced_token(self, vocab_size: int) -> int | None:
        """The only legal next token, if exactly one is (a draft that costs no model step)."""
        bitmask = allocate_bitmask(1, vocab_size)
        self.fill_bitmask(bitmask, 0)
        allowed = allowed_tokens(bitmask[0], vocab_size)
        return allowed[0] if len(allowed) == 1 else None


class Grammar(abc.ABC):
    """A compiled constraint for one tokenizer; immutable, shared by every sequence that uses it."""

    vocab_size: int  # the tokenizer's vocabulary: the width of its masks

    @abc.abstractmethod
    def matcher(self) -> Matcher:
        """A fresh matcher at the start of the grammar."""


class GrammarBackend(abc.ABC):
    """Compiles constraints for one tokenizer."""

    # identifies the tokenizer (and its end tokens) in the compile cache's keys
    key: str
    # mask width: the tokenizer's vocabulary; logits past it (padded embeddings) are masked out
    vocab_size: int

    @abc.abstractmethod
    def compile(self, constraint: Constraint) -> Grammar:
        """Compile, or raise ConstraintError saying what is wrong (the caller names the field)."""
