"""Replay runners: a model's greedy choices played back from a table, its forward time spent asleep.

Used by `duospec bench --simulate` to measure the pipeline as if each model had a device of its own
(a GPU does the arithmetic while the host core is free): the draft and target actors, the gRPC
streams, the coordinator and the verify rule all run for real; only the model forward is replaced.
The forward returns logits whose argmax is the token the real model chose for that prefix, then
sleeps until a measured cost model says the forward would have finished (`time.sleep` releases the
core, as waiting on a GPU would).

A replay checkpoint is an ordinary checkpoint directory (config.json and tokenizer files copied from
the real model, so the tokenizer-pair checks still apply) plus ``replay.json``:

    {"version": 1, "role": "target" | "draft", "cost": {...}, "entries": [
        {"prompt": [ids], "greedy": [the target's greedy continuation],
         "drafts": [[the draft's greedy continuation after prompt + greedy[:j]] for j = 0, 1, ...],
         "seconds": [the draft's second choice after prompt + greedy[:j]] (optional)}]}

The second choice gets logit SECOND_LOGIT (every other token 0), so the speculation cache's hedges
(draft_worker/hedges.py) see the draft's real next-best token where a hedge can be hit: right after
the tokens the target accepted.

Exact for greedy decoding, by construction: committed tokens always lie on the target's greedy path
(``greedy``), and after the last committed token a greedy drafter only ever appends its own choices
(``drafts[j]``). A lookup outside the table (a prompt that was not recorded, a draft deeper than the
table) is counted in ``misses`` and logged; sampling requests get the same one-hot choices (greedy only).
"""

from __future__ import annotations

import json
import logging
import pathlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from duospec.engine.errors import CheckpointError
from duospec.engine.runner import ModelRunner, SlotChunk

__all__ = ["REPLAY_FILE", "CostModel", "ReplayEntry", "ReplayRunner", "load_replay_runner", "write_replay_table"]

log = logging.getLogger(__name__)

REPLAY_FILE = "replay.json"
ROLES = ("target", "draft")
# The chosen token's logit; every other logit is 0. Softmax is one-hot in float32 up to temperature
# ~3; the bench replays greedy requests only.
CHOSEN_LOGIT = 100.0
SECOND_LOGIT = 50.0


@dataclass(frozen=True)
class CostModel:
    """Seconds one forward takes: piecewise-linear in the batch's total tokens, plus a fixed cost per
    extra sequence in the batch (measured by `duospec.bench.simulate.measure_costs`)."""

    tokens: tuple[int, ...]  # increasing
    seconds: tuple[float, ...]
    per_extra_sequence_s: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.seconds):
            raise ValueError("CostModel: tokens and seconds must be non-empty and of equal length")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:])):
            raise ValueError("CostModel: tokens must be strictly increasing")
        if min(self.seconds) < 0 or self.per_extra_sequence_s < 0:
            raise ValueError("CostModel: costs must be >= 0")

    def seconds_for(self, total_tokens: int, sequences: int = 1) -> float:
        # np.interp holds the end values flat; past the last point, extrapolate with the last slope.
        t, s = self.tokens, self.seconds
        if total_tokens > t[-1] and len(t) > 1:
            base = s[-1] + (total_tokens - t[-1]) * (s[-1] - s[-2]) / (t[-1] - t[-2])
        else:
            base = float(np.interp(total_tokens, t, s))
        return base + self.per_extra_sequence_s * max(0, sequences - 1)

    def to_json(self) -> dict:
        return {"tokens": list(self.tokens), "seconds": list(self.seconds),
                "per_extra_sequence_s": self.per_extra_sequence_s, "source": self.source}

    @classmethod
    def from_json(cls, data: dict) -> CostModel:
        return cls(tuple(int(t) for t in data["tokens"]), tuple(float(s) for s in data["seconds"]),
                   float(data.get("per_extra_sequence_s", 0.0)), str(data.get("source", "")))


@dataclass(frozen=True)
class ReplayEntry:
    prompt: tuple[int, ...]
    greedy: tuple[int, ...]  # the target's greedy continuation of the prompt
    drafts: tuple[tuple[int, ...], ...] = ()  # drafts[j]: the draft's continuation of prompt + greedy[:j]
    seconds: tuple[int, ...] = ()  # seconds[j]: the draft's second choice after prompt + greedy[:j]


def check_prompts_distinct(prompts) -> list[tuple[int, ...]]:
    """The distinct prompts, sorted; ValueError if one begins another (a replay slot's first chunk may
    hold prompt + drafts, so the match would be ambiguous). Sorted tuples put a prompt right before
    those it begins, so neighbours suffice."""
    ordered = sorted({tuple(p) for p in prompts})
    for shorter, longer in zip(ordered, ordered[1:]):
        if longer[: len(shorter)] == shorter:
            raise ValueError(f"replay table: a prompt of {len(shorter)} tokens begins a longer one; replay "
                             f"needs prompts none of which begins another")
    return ordered


def write_replay_table(directory: pathlib.Path, role: str, cost: CostModel, entries: Sequence[ReplayEntry]) -> None:
    if role not in ROLES:
        raise ValueError(f"role={role!r}: one of {ROLES}")
    data = {
        "version": 1,
        "role": role,
        "cost": cost.to_json(),
        "entries": [
            {"prompt": list(e.prompt), "greedy": list(e.greedy),
             **({"drafts": [list(d) for d in e.drafts]} if role == "draft" else {}),
             **({"seconds": list(e.seconds)} if role == "draft" and e.seconds else {})}
            for e in entries
        ],
    }
    (directory / REPLAY_FILE).write_text(json.dumps(data, separators=(",", ":")))


class _SlotState:
    __slots__ = ("entry", "history", "on_path")

    def __init__(self) -> None:
        self.entry: ReplayEntry | None = None
        self.history: list[int] = []
        self.on_path = 0  # how many generated tokens (after the prompt) equal greedy, from the start


class ReplayRunner(ModelRunner):
    backend = "replay"
    supports_trees = True  # each node answers for its own ancestors' history

    def __init__(self, config, role: str, cost: CostModel, entries: Sequence[ReplayEntry], *, max_slots: int,
                 max_context: int) -> None:
        super().__init__(max_slots, max_context)
        if role not in ROLES:
            raise ValueError(f"role={role!r}: one of {ROLES}")
        self.config = config
        self.role = role
        self.cost = cost
        self.vocab_size = int(config.vocab_size)
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        unique = {e.prompt: e for e in entries}  # identical prompts have identical tables
        self.entries = [unique[prompt] for prompt in check_prompts_distinct(unique)]
        self._slots = [_SlotState() for _ in range(max_slots)]
        self.misses = 0
        self.off_path_branches = 0  # draft rows on hedges that can never be hit
        self.forwards = 0
        self.simulated_seconds = 0.0

    def _on_allocate(self, slot: int) -> None:
        self._slots[slot] = _SlotState()

    def _move_positions(self, slot: int, src: list[int], dst: list[int]) -> None:
        state = self._slots[slot]
        moved = [state.history[s] for s in src]
        for d, token in zip(dst, moved):
            state.history[d] = token
        if state.entry is not None:  # the greedy-path count holds up to the first moved position only
            state.on_path = min(state.on_path, max(0, min(dst) - len(state.entry.prompt)))

    def _copy_prefix(self, src: int, dst: int, length: int) -> None:
        state, source = _SlotState(), self._slots[src]
        state.entry, state.history = source.entry, source.history[:length]
        state.on_path = min(source.on_path, max(0, length - len(source.entry.prompt))) if source.entry else 0
        self._slots[dst] = state

    def _forward(self, chunks: Sequence[SlotChunk], *, last_only: bool, to_cpu: bool):
        started = time.perf_counter()
        rows_per_chunk = [self._choices(chunk, last_only) for chunk in chunks]
        total = sum(len(c.token_ids) for c in chunks)
        self._commit_lengths(chunks)
        out = [self._logits(rows) for rows in rows_per_chunk]
        cost = self.cost.seconds_for(total, len(chunks))
        self.forwards += 1
        self.simulated_seconds += cost
        remaining = started + cost - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return torch.cat(out) if last_only else out

    def _logits(self, rows: list[tuple[int, int | None]]) -> torch.Tensor:
        logits = torch.zeros(len(rows), self.vocab_size)
        logits[torch.arange(len(rows)), torch.tensor([chosen for chosen, _ in rows])] = CHOSEN_LOGIT
        for i, (chosen, second) in enumerate(rows):
            if second is not None and second != chosen:
                logits[i, second] = SECOND_LOGIT
        return logits

    # -- table lookups -------------------------------------------------------------------------
    def _choices(self, chunk: SlotChunk, last_only: bool) -> list[tuple[int, int | None]]:
        state = self._slots[chunk.slot]
        del state.history[chunk.start_pos:]
        state.history.extend(chunk.token_ids)
        if state.entry is None or chunk.start_pos < len(state.entry.prompt):
            state.entry = self._match(state.history)
            state.on_path = 0
        entry = state.entry
        p_len = len(entry.prompt)
        state.on_path = min(state.on_path, max(0, chunk.start_pos - p_len))
        _extend_on_path(state)
        if chunk.parents is not None:
            return self._tree_choices(state, chunk)
        first = chunk.start_pos + len(chunk.token_ids) - 1 if last_only else chunk.start_pos
        return [self._next_token(state, pos) for pos in range(first, chunk.start_pos + len(chunk.token_ids))]

    def _tree_choices(self, state: _SlotState, chunk: SlotChunk) -> list[tuple[int, int | None]]:
        """A token tree: every node answers as if the slot held the prefix and its ancestors only."""
        prefix = state.history[: chunk.start_pos]
        paths: list[list[int]] = []
        rows = []
        for i, parent in enumerate(chunk.parents):
            paths.append((paths[parent] if parent >= 0 else []) + [chunk.token_ids[i]])
            node = _SlotState()
            node.entry, node.history = state.entry, prefix + paths[i]
            _extend_on_path(node)
            rows.append(self._next_token(node, len(node.history) - 1))
        return rows

    def _match(self, history: list[int]) -> ReplayEntry:
        for entry in self.entries:
            n = len(entry.prompt)
            if n <= len(history) and tuple(history[:n]) == entry.prompt:
                return entry
        raise ValueError(
            "replay runner: this prompt was not recorded in the replay table; a replay checkpoint answers "
            "only the prompts it was built for (rebuild it with `duospec bench --simulate` on these prompts)"
        )

    def _next_token(self, state: _SlotState, pos: int) -> tuple[int, int | None]:
        """The model's greedy choice after history[:pos + 1], and its second choice where recorded."""
        entry = state.entry
        generated = pos + 1 - len(entry.prompt)  # tokens after the prompt within the prefix
        if generated < 0:
            return entry.greedy[0], None  # a prompt row: its logits are never used
        on_path = min(state.on_path, generated)
        if self.role == "target":
            if on_path < generated or generated < len(entry.greedy):
                # Off the greedy path, the target's row is past the first rejected draft: never used.
                return entry.greedy[min(generated, len(entry.greedy) - 1)], None
            return self._miss(entry.greedy[-1], f"target position {generated} past the recorded greedy path"), None
        own = generated - on_path  # the drafter's own tokens after the last on-path one
        drafts = entry.drafts[on_path] if on_path < len(entry.drafts) else ()
        known = list(drafts[:own])  # the recorded part of the drafter's own tokens
        if own and state.history[pos + 1 - own : pos + 1 - own + len(known)] != known:
            # Off both the target's path and the draft's own: a hedge on another alternative (draft_worker/
            # hedges.py) — the main line only ever holds the draft's recorded choices. Nothing can hit
            # it, so any continuation will do; not a miss.
            self.off_path_branches += 1
            return (drafts[0] if drafts else entry.greedy[-1]), None
        if own >= len(drafts):
            return self._miss(entry.greedy[-1], f"draft depth {own} after {on_path} committed tokens not recorded"), None
        second = entry.seconds[on_path] if own == 0 and on_path < len(entry.seconds) else None
        return drafts[own], second

    def _miss(self, token: int, why: str) -> int:
        if self.misses == 0:
            log.warning("replay %s: %s (further misses are only counted)", self.role, why)
        self.misses += 1
        return token


def _extend_on_path(state: _SlotState) -> None:
    """Counts on: how many generated tokens of the slot's history follow the greedy path."""
    entry, p_len = state.entry, len(state.entry.prompt)
    while (state.on_path < len(entry.greedy) and p_len + state.on_path < len(state.history)
           and state.history[p_len + state.on_path] == entry.greedy[state.on_path]):
        state.on_path += 1


def load_replay_runner(directory: pathlib.Path, config, *, max_slots: int, max_context: int) -> ReplayRunner:
    path = directory / REPLAY_FILE
    try:
        data = json.loads(path.read_text())
        version = data.get("version")
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path}: not a readable replay table ({exc})") from exc
    if version != 1:
        raise CheckpointError(f"{path}: version {version!r}; this duospec reads version 1")
    try:
        role = data["role"]
        cost = CostModel.from_json(data["cost"])
        entries = [
            ReplayEntry(tuple(e["prompt"]), tuple(e["greedy"]), tuple(tuple(d) for d in e.get("drafts", ())),
                        tuple(e.get("seconds", ())))
            for e in data["entries"]
        ]
        if role == "draft" and any(not e.drafts for e in entries):
            raise ValueError("a draft table needs 'drafts' in every entry")
        return ReplayRunner(config, role, cost, entries, max_slots=max_slots, max_context=max_context)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: not a usable replay table ({exc})") from exc
