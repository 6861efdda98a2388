"""Constraints on the internal wire (pearl.proto `GrammarConstraint`): the coordinator writes what the
target compiles, so both read one constraint the same way."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from duospec.internal.v1 import pearl_pb2 as pb
from duospec.structured.constraint import Constraint, ConstraintKind

_TO_PROTO = {
    ConstraintKind.JSON_SCHEMA: pb.CONSTRAINT_KIND_JSON_SCHEMA,
    ConstraintKind.JSON_OBJECT: pb.CONSTRAINT_KIND_JSON_OBJECT,
    ConstraintKind.REGEX: pb.CONSTRAINT_KIND_REGEX,
    ConstraintKind.GRAMMAR: pb.CONSTRAINT_KIND_GRAMMAR,
}
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}


def constraint_to_proto(constraint: Constraint, output_start: int, end_token_ids: Iterable[int]) -> pb.GrammarConstraint:
    return pb.GrammarConstraint(kind=_TO_PROTO[constraint.kind], text=constraint.text, output_start=output_start,
                                end_token_ids=sorted(int(t) for t in end_token_ids))


def constraint_from_proto(msg: pb.GrammarConstraint) -> Constraint | None:
    """None: the item carries no constraint."""
    if msg.kind == pb.CONSTRAINT_KIND_UNSPECIFIED:
        return None
    return Constraint(_FROM_PROTO[msg.kind], msg.text)


def add_grammar_work(total: pb.GrammarWork, work: pb.GrammarWork) -> None:
    """Adds one report's grammar work to a running total (merged messages, the scheduler's sums)."""
    total.mask_seconds += work.mask_seconds
    total.mask_rows += work.mask_rows
    total.forced_tokens += work.forced_tokens


class GrammarWorkReport:
    """What a worker's grammar counters grew by since its previous message (pearl.proto GrammarWork).
    `read` returns its cumulative (mask seconds, mask rows, forced tokens)."""

    def __init__(self, read: Callable[[], tuple[float, int, int]]) -> None:
        self._read = read
        self._last = read()

    def take(self) -> pb.GrammarWork | None:
        """The growth since the last call; None when there was none (nothing constrained ran)."""
        now = self._read()
        seconds, rows, forced = (a - b for a, b in zip(now, self._last))
        self._last = now
        return pb.GrammarWork(mask_seconds=seconds, mask_rows=rows, forced_tokens=forced) if rows or forced else None
