"""Compiling constraints once, and holding each constrained sequence's authoritative matcher.

- `GrammarCompiler`: compiled grammars cached by (constraint, tokenizer), LRU-bounded; `compile_async`
  runs a compile on its own small thread pool (never the event loop, never the default executor that
  other work shares) with a time limit.
- `SequenceGrammars`: the target worker's matchers, one per constrained sequence, advanced only by
  committed tokens (DESIGN §4, "Constrained requests"). For a verify item it moves the matcher to the
  item's first draft position and fills one mask row per verify row: row 0 after the context, row
  1 + i after draft node i. Drafts are consumed only tentatively and rolled back before the verdict.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from duospec.structured.backend import Grammar, GrammarBackend, Matcher, allocate_bitmask
from duospec.structured.constraint import DEFAULT_COMPILE_TIMEOUT_S, Constraint, ConstraintError

DEFAULT_CACHE_ENTRIES = 256
# How long a worker waits for a new constraint's compile in its loop: a usual schema compiles within
# it; a slower one goes on in the background while the worker serves its other sequences.
INLINE_COMPILE_S = 0.02


class GrammarCompiler:
    """One backend (one tokenizer) and its compile cache. Thread-safe."""

    def __init__(self, backend: GrammarBackend, *, max_entries: int = DEFAULT_CACHE_ENTRIES,
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S, threads: int = 2) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self._max_entries = max_entries
        self._cache: OrderedDict[tuple[Constraint, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar-compile")
        self._pending: dict[tuple[Constraint, str], Future] = {}  # compiles `prepare` started
        self.compiles = 0  # cache misses compiled (a metric and what the cache tests count)
        self.compile_seconds = 0.0

    def compile(self, constraint: Constraint) -> Grammar:
        """The cached grammar, compiling it on a miss (in the calling thread); ConstraintError if bad."""
        key = (constraint, self.backend.key)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        started = time.perf_counter()
        grammar = self.backend.compile(constraint)  # outside the lock: compiles of others go on
        with self._lock:
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - started
            self._cache[key] = grammar
            while len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)
        return grammar

    def prepare(self, constraint: Constraint, wait_s: float = 0.0) -> Future | None:
        """None once `constraint` is compiled (cached, or its compile is done: `compile` then returns it
        at once); ConstraintError if that compile failed; else the future of its compile on the pool,
        started by the first call and awaited up to `wait_s` here. A worker defers a sequence whose
        grammar is not ready instead of stalling the batch it shares with others."""
        key = (constraint, self.backend.key)
        with self._lock:
            if key in self._cache:
                self._pending.pop(key, None)  # a compile no one asked about again since it ended
                return None
            future = self._pending.get(key)
            if future is None:
                future = self._pending[key] = self._pool.submit(self._compile_or_error, constraint)
        if wait_s > 0:
            wait([future], timeout=wait_s)  # outside the lock: the compile takes it to store its result
        if not future.done():
            return future
        with self._lock:
            self._pending.pop(key, None)
        error = future.result()
        if error is not None:
            raise error
        return None

    def _compile_or_error(self, constraint: Constraint) -> ConstraintError | None:
        try:
            self.compile(constraint)
        except ConstraintError as exc:
            return exc
        except Exception as exc:  # a backend's own failure: the sequence ends with it, the worker goes on
            return ConstraintError(f"did not compile: {exc}")
        return None

    async def compile_async(self, constraint: Constraint, timeout_s: float | None = None) -> Grammar:
        """`compile` on the compile pool, given up after the time limit with a ConstraintError. The
        abandoned compile runs on within llguidance's fuel limits and lands in the cache."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        future = asyncio.get_running_loop().run_in_executor(self._pool, self.compile, constraint)
        try:
            return await asyncio.wait_for(asyncio.shield(future), limit)
        except asyncio.TimeoutError:
            raise ConstraintError(f"did not compile within {limit:g} s; simplify it") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class WorkerCompilers:
    """A worker's compilers, one per set of end tokens (each constraint names the model's end tokens,
    which every grammar admits once complete), made on first use from the tokenizer at
    `tokenizer_path`; `factory(end_token_ids)` in its place builds them another way (tests)."""

    def __init__(self, tokenizer_path: str | None, factory=None) -> None:
        self._tokenizer_path = tokenizer_path
        self._factory = factory
        self._compilers: dict[tuple[int, ...], GrammarCompiler] = {}

    def get(self, end_token_ids: Sequence[int]) -> GrammarCompiler:
        key = tuple(sorted(int(t) for t in end_token_ids))
        compiler = self._compilers.get(key)
        if compiler is None:
            if self._factory is not None:
                compiler = self._factory(key)
            elif self._tokenizer_path is None:
                raise ConstraintError("this worker was started without a tokenizer for constraints")
            else:
                from duospec.structured.llguidance_backend import LLGuidanceBackend  # only once one is asked for

                compiler = GrammarCompiler(LLGuidanceBackend.from_pretrained(self._tokenizer_path, key))
            self._compilers[key] = compiler
        return compiler

    def stats(self) -> dict:
        compilers = self._compilers.values()
        return {"grammar_compiles": sum(c.compiles for c in compilers),
                "grammar_compile_seconds": sum(c.compile_seconds for c in compilers)}


class GrammarStateError(ValueError):
    """The sequence cannot go on under its grammar (a dead end, or a committed token it forbids)."""


@dataclass
class _State:
    grammar: Grammar
    matcher: Matcher
    output_start: int  # position of the first generated token: the grammar covers positions from here
    vocab_size: int  # the tokenizer's: the masks' width
    tokens: list[int] = field(default_factory=list)  # consumed: the tokens at output_start, output_start + 1, ...

    @property
    def end(self) -> int:
        return self.output_start + len(self.tokens)


@dataclass(frozen=True)
class ItemMasks:
    """The masks of one verify item: ``bitmask[r]`` for its verify row r (k + 1 rows)."""

    bitmask: torch.Tensor  # [k + 1, ceil(V / 32)] int32
    # rows where the grammar allows no token (a dead end; left all-allowed so the rule stays finite):
    # a verdict that reaches one stops before it (Verdict.grammar_dead_end)
    dead_rows: frozenset[int] = frozenset()

    def cut_at_dead_end(self, path: Sequence[int]) -> int | None:
        """How many nodes of an accepted `path` (root first) stand before the first dead row it
        reaches (row 0: the item's first position; row 1 + i: after node i); None: it reaches none."""
        if not self.dead_rows:
            return None
        for j, row in enumerate([0, *(node + 1 for node in path)]):
            if row in self.dead_rows:
                return j
        return None


class SequenceGrammars:
    """The target worker's authoritative matchers, keyed by sequence id."""

    def __init__(self) -> None:
        self._states: dict[int, _State] = {}
        self.mask_rows = 0  # metrics: mask rows filled ...
        self.mask_seconds = 0.0  # ... and the time spent on them (sync, masks, rollback)
        self.replays = 0  # rollbacks done by replaying the committed tokens into a fresh matcher

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def open(self, seq_id: int, grammar: Grammar, output_start: int) -> None:
        """(Re)start `seq_id` at the grammar's start; positions < output_start are the prompt."""
        self._states[seq_id] = _State(grammar, grammar.matcher(), output_start, grammar.vocab_size)

    def release(self, seq_id: int) -> None:
        self._states.pop(seq_id, None)

    def prepare(self, seq_id: int, start_pos: int, context: Sequence[int], draft_tokens: Sequence[int],
                parents: Sequence[int] | None = None) -> ItemMasks | None:
        """Move the matcher to the item's first draft position (rolling back what the item's context
        replaces, consuming its new committed tokens) and return its masks; None: unconstrained."""
        state = self._states.get(seq_id)
        if state is None:
            return None
        started = time.perf_counter()
        self._sync(state, start_pos, context)
        bitmask = allocate_bitmask(len(draft_tokens) + 1, state.vocab_size)
        state.matcher.fill_bitmask(bitmask, 0)
        if not _any(bitmask[0]) or state.matcher.is_dead_end():  # nothing to verify, the sequence ends
            bitmask.fill_(-1)
            dead = {0}
        else:
            parents = list(parents) if parents else list(range(-1, len(draft_tokens) - 1))
            dead = self._fill_draft_rows(state.matcher, [int(t) for t in draft_tokens], parents, bitmask)
        self.mask_rows += len(draft_tokens) + 1
        self.mask_seconds += time.perf_counter() - started
        return ItemMasks(bitmask, frozenset(dead))

    def commit(self, seq_id: int, position: int, tokens: Sequence[int]) -> None:
        """The verdict committed `tokens` at `position`, `position` + 1, ...: consume them."""
        state = self._states.get(seq_id)
        if state is None:
            return
        self._sync(state, position, ())
        tokens = [int(t) for t in tokens]
        legal = state.matcher.accept_tokens(tokens)
        state.tokens.extend(tokens[:legal])
        if legal < len(tokens):
            raise GrammarStateError(f"committed token {tokens[legal]} is not legal under the constraint")

    def follow(self, seq_id: int, tokens: Sequence[int], stable: int) -> bool:
        """Make `seq_id`'s matcher hold `tokens` (the whole sequence, from position 0; the positions
        before `stable` are unchanged since the last call). False where a token is illegal: the matcher
        then holds the legal part (a drafter drafts on unmasked; the target decides). For drafters."""
        state = self._states[seq_id]
        start = max(state.output_start, min(stable, state.end))
        try:
            self._sync(state, start, tokens[start:])
        except GrammarStateError:
            return False
        return True

    def fork_following(self, seq_id: int, tokens: Sequence[int]) -> Matcher | None:
        """A copy of `seq_id`'s matcher holding `tokens` (the whole of another sequence that shares a
        prefix with it: a drafter's hedge), the original untouched; None where a token is illegal."""
        state = self._states[seq_id]
        ours = tokens[state.output_start:]
        common = 0
        while common < min(len(ours), len(state.tokens)) and ours[common] == state.tokens[common]:
            common += 1
        fork = state.matcher.fork()
        try:
            fork.rollback(len(state.tokens) - common)
        except RuntimeError:
            fork = state.grammar.matcher()
            fork.accept_tokens(state.tokens[:common])
        rest = [int(t) for t in ours[common:]]
        return fork if fork.accept_tokens(rest) == len(rest) else None

    def fill(self, seq_id: int, bitmask: torch.Tensor, row: int = 0) -> None:
        started = time.perf_counter()
        self._states[seq_id].matcher.fill_bitmask(bitmask, row)
        self.mask_rows += 1
        self.mask_seconds += time.perf_counter() - started

    def consumed(self, seq_id: int) -> list[int]:
        """The tokens the sequence's matcher has consumed (tests: a fresh replay must agree)."""
        return list(self._states[seq_id].tokens)

    def matcher(self, seq_id: int) -> Matcher:
        return self._states[seq_id].matcher

    def _sync(self, state: _State, start_pos: int, context: Sequence[int]) -> None:
        """Make the matcher hold exactly the committed tokens before start_pos + len(context)."""
        if start_pos > state.end:
            raise GrammarStateError(f"the grammar state ends at position {state.end}, the item starts at "
                                    f"{start_pos}; resend the sequence from position 0")
        keep = max(0, start_pos - state.output_start)  # consumed tokens before the item: kept
        new = [(start_pos + i, int(t)) for i, t in enumerate(context) if start_pos + i >= state.output_start]
        # context tokens the matcher already holds (the newest committed token, fed again as the
        # next item's context) stay consumed; from the first difference on, roll back and consume
        for pos, token in new:
            index = pos - state.output_start
            if index < len(state.tokens) and state.tokens[index] == token:
                keep = index + 1
            else:
                break
        if keep < len(state.tokens):
            del state.tokens[keep:]
            try:
                state.matcher.rollback(state.matcher.num_tokens - keep)
            except RuntimeError:  # the library could not roll back that far: replay the committed tokens
                state.matcher = state.grammar.matcher()
                if state.matcher.accept_tokens(state.tokens) != keep:
                    raise GrammarStateError("the committed tokens no longer replay under the constraint") from None
                self.replays += 1
        fresh = [t for pos, t in new if pos - state.output_start >= keep]
        legal = state.matcher.accept_tokens(fresh)
        state.tokens.extend(fresh[:legal])
        if legal < len(fresh):
            raise GrammarStateError(f"committed token {fresh[legal]} is not legal under the constraint")

    @staticmethod
    def _fill_draft_rows(matcher: Matcher, tokens: list[int], parents: list[int], bitmask: torch.Tensor) -> set[int]:
        """Row 1 + i: the mask after draft node i. A node whose token is illegal (or below such a
        node) leaves its row all-allowed: the verify rule rejects the illegal token at its own row
        (greedy: it is not the masked argmax; sampled: masked p gives it 0), so the rows under it
        decide nothing. A sampled draft is never cut before the rule runs (DESIGN §4). Returns the
        rows after legal nodes where nothing is legal (dead ends), left all-allowed: a verdict
        whose path takes such a node stops there, as the target alone would."""
        dead: set[int] = set()
        path: list[int] = []  # the nodes the matcher holds tentatively, root first
        legal = [False] * len(tokens)
        for node, token in enumerate(tokens):
            parent = parents[node]
            if parent >= 0 and not legal[parent]:
                continue
            wanted = _ancestors(parents, parent)
            common = 0
            while common < min(len(path), len(wanted)) and path[common] == wanted[common]:
                common += 1
            if common < len(path):
                matcher.rollback(len(path) - common)
                del path[common:]
            for extra in wanted[common:]:  # known legal: each was consumed before
                matcher.accept_tokens([tokens[extra]])
                path.append(extra)
            if matcher.accept_tokens([token]) == 1:
                legal[node] = True
                path.append(node)
                matcher.fill_bitmask(bitmask, node + 1)
                if not _any(bitmask[node + 1]) or matcher.is_dead_end():
                    bitmask[node + 1].fill_(-1)
                    dead.add(node + 1)
        matcher.rollback(len(path))
        return dead


def _ancestors(parents: list[int], node: int) -> list[int]:
    """Root-first nodes from a root down to `node` (empty for -1)."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def _any(row: torch.Tensor) -> bool:
    return bool((row != 0).any())
