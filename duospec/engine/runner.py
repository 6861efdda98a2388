"""The model-runner interface every worker and decoder calls, and the slot bookkeeping it shares.

Glossary:
    slot     one sequence's KV-cache row. A runner has ``max_slots`` of them; a sequence holds one from
             ``allocate_slot()`` until ``free_slot()``.
    length   how many positions of a slot hold valid keys/values (positions ``0 .. length-1``).
    chunk    ``SlotChunk(slot, start_pos, token_ids)``: "these tokens sit at positions
             ``start_pos ..``; compute their logits and cache them". The slot is first truncated to
             ``start_pos``, so re-feeding a position after a rejection overwrites what was there.
    rollback ``truncate(slot, length)``: a single integer; rejected positions are overwritten later.
    branch   ``copy_prefix(src, dst, length)``: ``dst`` starts out holding ``src``'s first ``length``
             positions (the drafter's hedges grow that way next to the main line).
    tree     a chunk with ``parents``: token i's parent is token ``parents[i]`` of the chunk (-1: the
             slot's token before ``start_pos``); it sits at position ``start_pos + depth(i)``, attends
             to the slot's prefix and its own ancestors, and is cached at index ``start_pos + i``.
             ``keep_path(slot, start_pos, path)`` then moves the accepted path to its positions and
             drops the rest — at most the path's length in copies. A chain is ``parents = [-1, 0, ...]``.

Paged backends (the lean one) keep a slot's positions in blocks of one pool (duospec/engine/blocks.py,
``self.kv``): a slot costs nothing until it holds positions, ``max_context`` bounds one sequence, and
the pool bounds them all together (a forward that needs more blocks than are free raises
``BlocksExhausted`` and changes nothing). Their prefix cache: ``commit(slot, n)`` declares positions
``0 .. n-1`` verified (only those are ever cached), ``match_prefix`` adopts cached blocks of a
sequence's verified tokens from an earlier sequence with the same ``cache_salt``.

Logits are returned as float32 on the CPU by default; ``to_cpu=False`` keeps them float32 on the
runner's device, and ``forward_for_verify`` (the target's) returns only the rows the verify rule
reads, on the device, where `duospec.verify.batch` decides the batch.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from duospec.trees import tree_depths
from duospec.engine.blocks import BlockTables, CacheStats
from duospec.engine.errors import SlotsExhausted

__all__ = ["SlotChunk", "ModelRunner"]


@dataclass(frozen=True)
class SlotChunk:
    slot: int
    # position of token_ids[0]; the slot is truncated to start_pos before the chunk is written
    start_pos: int
    # [n_tokens], n_tokens >= 1; a list/tuple of ints (not a tensor: ids are indexed on the host)
    token_ids: Sequence[int]
    # None: a chain. Else [n_tokens] parent of each token within the chunk, -1 = the slot's previous token
    parents: Sequence[int] | None = None

    def depths(self) -> list[int]:
        """Position offset of each token from start_pos (a chain: 0, 1, 2, ...)."""
        if self.parents is None:
            return list(range(len(self.token_ids)))
        return tree_depths(self.parents)


class ModelRunner(abc.ABC):
    """A causal LM with a per-slot KV cache, driven by ragged batches of ``SlotChunk``.

    Attributes (set by subclasses): ``vocab_size`` (logits width, the model's), ``max_context``
    (positions per slot), ``max_slots``, ``device``, ``dtype`` (weights and cache), ``backend``
    ("lean" or "hf"), ``config`` (the transformers config).
    """

    vocab_size: int
    max_context: int
    max_slots: int
    device: torch.device
    dtype: torch.dtype
    backend: str
    supports_trees: bool = False  # chunks with `parents` and keep_path (the lean and replay backends)
    supports_hidden: bool = False  # forward_with_hidden (the lean backend)
    kv: BlockTables | None = None  # paged backends: every slot's block table over one pool

    def __init__(self, max_slots: int, max_context: int) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots={max_slots}: must be >= 1")
        if max_context < 1:
            raise ValueError(f"max_context={max_context}: must be >= 1")
        self.max_slots = max_slots
        self.max_context = max_context
        # None = free; an int = allocated, holding that many valid positions.
        self._lengths: list[int | None] = [None] * max_slots

    # ---- slots -------------------------------------------------------------------------------

    def allocate_slot(self, cache_salt: str = "") -> int:
        """Return a free slot (lowest index first) with length 0. `cache_salt`: whose prefix cache the
        slot shares (a tenant; "" = every sequence of this runner's model)."""
        for slot, length in enumerate(self._lengths):
            if length is None:
                self._lengths[slot] = 0
                if self.kv is not None:
                    self.kv.open(slot, cache_salt)
                self._on_allocate(slot)
                return slot
        raise SlotsExhausted(
            f"all {self.max_slots} KV-cache slots are in use; free a slot (free_slot) or load the "
            f"model with a larger max_slots"
        )

    def free_slot(self, slot: int) -> None:
        self._check_allocated(slot)
        self._lengths[slot] = None
        if self.kv is not None:
            self.kv.close(slot)
        self._on_free(slot)

    def slot_length(self, slot: int) -> int:
        return self._check_allocated(slot)

    def truncate(self, slot: int, length: int) -> None:
        """Roll ``slot`` back to ``length`` valid positions (``0 <= length <= slot_length``)."""
        current = self._check_allocated(slot)
        if not 0 <= length <= current:
            raise ValueError(f"truncate(slot={slot}, length={length}): length must be in [0, {current}]")
        self._set_length(slot, length)

    def _set_length(self, slot: int, length: int) -> None:
        self._lengths[slot] = length
        if self.kv is not None:
            self.kv.truncate(slot, length)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Make slot ``dst`` hold what slot ``src`` holds at positions ``0 .. length-1``."""
        src_len = self._check_allocated(src)
        self._check_allocated(dst)
        if src == dst or not 0 <= length <= src_len:
            raise ValueError(f"copy_prefix(src={src}, dst={dst}, length={length}): need src != dst and "
                             f"length in [0, {src_len}]")
        if self.kv is not None:  # shares src's blocks (a later write copies the one it touches), or copies
            copies = self.kv.fork(src, dst, length)
            if copies:
                self._copy_blocks(copies)
        else:
            self._copy_prefix(src, dst, length)
        self._lengths[dst] = length

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Paged backends: each (source, copy) block's contents into the copy."""
        raise NotImplementedError(f"the {self.backend} backend has no KV blocks")

    def _copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Backend part of ``copy_prefix`` for slot backends (arguments validated)."""
        raise NotImplementedError(f"the {self.backend} backend cannot copy a slot")

    # ---- prefix cache (paged backends; elsewhere these change nothing) -----------------------

    def commit(self, slot: int, length: int) -> None:
        """Positions ``0 .. length-1`` of ``slot`` hold verified tokens: their full blocks may serve
        later sequences with the slot's cache salt. Never pass draft positions."""
        current = self._check_allocated(slot)
        if not 0 <= length <= current:
            raise ValueError(f"commit(slot={slot}, length={length}): length must be in [0, {current}]")
        if self.kv is not None:
            self.kv.commit(slot, length)

    def match_prefix(self, slot: int, start_pos: int, token_ids: Sequence[int]) -> int:
        """``slot`` holds verified tokens at ``0 .. start_pos-1`` and ``token_ids`` (verified) follow:
        take cached blocks for as many of them as the prefix cache holds, at least the last token
        left out. Returns the position to feed from (``start_pos`` on a miss); the slot then holds
        that many positions."""
        current = self._check_allocated(slot)
        if not 0 <= start_pos <= current or not token_ids:
            raise ValueError(f"match_prefix(slot={slot}, start_pos={start_pos}): need start_pos in "
                             f"[0, {current}] and at least one token")
        if self.kv is None:
            return start_pos
        self._set_length(slot, start_pos)
        reached = self.kv.match(slot, start_pos, token_ids)
        self._lengths[slot] = reached
        return reached

    def cache_stats(self) -> CacheStats | None:
        """The KV pool and prefix cache counters (None: a slot backend)."""
        return self.kv.stats() if self.kv is not None else None

    def kv_stats(self) -> dict:
        """The same as a worker reports them ({} for a slot backend)."""
        stats = self.cache_stats()
        if stats is None:
            return {}
        return {"kv_blocks": stats.num_blocks, "kv_free_blocks": stats.free_blocks, "kv_usage": stats.usage,
                "prefix_cache_queries": stats.queries, "prefix_cache_hits": stats.hits}

    def keep_path(self, slot: int, start_pos: int, path: Sequence[int]) -> None:
        """After a tree chunk at ``start_pos``: keep only the tokens at chunk indices ``path`` (root
        first, each the parent of the next), moved to positions ``start_pos, start_pos + 1, ...``."""
        length = self._check_allocated(slot)
        path = [int(i) for i in path]
        if not (0 <= start_pos <= length and all(0 <= i < length - start_pos for i in path)
                and all(a < b for a, b in zip(path, path[1:]))):
            raise ValueError(f"keep_path(slot={slot}, start_pos={start_pos}, path={path}): indices must increase "
                             f"and lie within the {length - start_pos} tokens cached from start_pos")
        moves = [(start_pos + i, start_pos + d) for d, i in enumerate(path) if i != d]
        if moves:
            src, dst = [s for s, _ in moves], [d for _, d in moves]
            if self.kv is not None:
                self.kv.move(slot, src, dst)
            self._move_positions(slot, src, dst)
        self._set_length(slot, start_pos + len(path))

    def _move_positions(self, slot: int, src: list[int], dst: list[int]) -> None:
        raise NotImplementedError(f"the {self.backend} backend has no token trees")

    @property
    def free_slots(self) -> int:
        return sum(length is None for length in self._lengths)

    def _check_allocated(self, slot: int) -> int:
        if not (isinstance(slot, int) and 0 <= slot < self.max_slots):
            raise ValueError(f"slot={slot!r}: not a slot index in [0, {self.max_slots})")
        length = self._lengths[slot]
        if length is None:
            raise ValueError(f"slot={slot}: not allocated (allocate_slot() first, or it was freed)")
        return length

    def _on_allocate(self, slot: int) -> None:
        """Hook for backends that keep per-slot objects."""

    def _on_free(self, slot: int) -> None:
        """Hook for backends that keep per-slot objects."""

    # ---- forward -----------------------------------------------------------------------------

    def forward(self, chunks: Sequence[SlotChunk], *, to_cpu: bool = True) -> list[torch.Tensor]:
        """One batched forward over a ragged list of chunks (at most one chunk per slot).

        Returns per chunk float32 logits ``[n_tokens, vocab_size]``: row j is the distribution of
        the token after ``token_ids[j]``. On the CPU unless ``to_cpu=False``. Afterwards each slot's
        length is ``start_pos + n_tokens``.
        """
        self._validate(chunks)
        return self._forward(chunks, last_only=False, to_cpu=to_cpu)

    def forward_last(self, chunks: Sequence[SlotChunk], *, to_cpu: bool = True) -> torch.Tensor:
        """Like ``forward`` but only each chunk's last position: float32 ``[len(chunks), vocab_size]``.
        Cheaper (the LM head runs on one row per chunk); the drafter's hot path."""
        self._validate(chunks)
        return self._forward(chunks, last_only=True, to_cpu=to_cpu)

    def forward_with_hidden(self, chunks: Sequence[SlotChunk]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Like ``forward`` (logits on the CPU), plus per chunk the final hidden states
        ``[n_tokens, hidden_size]`` float32: the rows the LM head reads (after the final norm). The
        target sends these to head drafters (EAGLE, Medusa)."""
        raise NotImplementedError(f"the {self.backend} backend does not return hidden states")

    def forward_for_verify(self, chunks: Sequence[SlotChunk], first_rows: Sequence[int], *,
                           hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The verifier's forward: the logits of rows ``first_rows[i] ..`` of each chunk (the rows the
        verify rule reads), flat ``[R, vocab]`` float32 on the runner's device — no copy to the host.
        With ``hidden`` (backends with ``supports_hidden``), also every row's final hidden state,
        flat ``[N, hidden_size]`` float32 on the device. Slot lengths as after ``forward``."""
        self._validate(chunks)
        if len(first_rows) != len(chunks) or any(not 0 <= r < len(c.token_ids) for r, c in zip(first_rows, chunks)):
            raise ValueError(f"first_rows {list(first_rows)}: need one row index per chunk, within the chunk")
        if hidden and not self.supports_hidden:
            raise NotImplementedError(f"the {self.backend} backend does not return hidden states")
        return self._forward_rows(chunks, first_rows, hidden)

    def _forward_rows(self, chunks: Sequence[SlotChunk], first_rows: Sequence[int],
                      hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Backend part of ``forward_for_verify``; this default slices a full forward on the device."""
        logits = self._forward(chunks, last_only=False, to_cpu=False)
        return torch.cat([rows[first:] for rows, first in zip(logits, first_rows)]), None

    @abc.abstractmethod
    def _forward(self, chunks: Sequence[SlotChunk], *, last_only: bool, to_cpu: bool):
        """Run validated chunks; update the slot lengths. Returns a list (last_only=False) or a
        stacked tensor (last_only=True)."""

    def _validate(self, chunks: Sequence[SlotChunk]) -> None:
        if not chunks:
            raise ValueError("forward: chunks is empty; pass at least one SlotChunk")
        seen: set[int] = set()
        for i, chunk in enumerate(chunks):
            length = self._check_allocated(chunk.slot)
            if chunk.slot in seen:
                raise ValueError(f"chunks[{i}]: slot {chunk.slot} appears twice in one forward; merge the chunks")
            seen.add(chunk.slot)
            if not isinstance(chunk.token_ids, (list, tuple, range)):
                raise TypeError(
                    f"chunks[{i}] (slot {chunk.slot}): token_ids is a {type(chunk.token_ids).__name__}; "
                    f"pass a list of ints (e.g. tensor.tolist())"
                )
            n = len(chunk.token_ids)
            if n < 1:
                raise ValueError(f"chunks[{i}] (slot {chunk.slot}): token_ids is empty")
            if not 0 <= chunk.start_pos <= length:
                raise ValueError(
                    f"chunks[{i}] (slot {chunk.slot}): start_pos={chunk.start_pos} but the slot holds "
                    f"{length} positions; start_pos must be in [0, {length}] (no gaps)"
                )
            if chunk.start_pos + n > self.max_context:
                raise ValueError(
                    f"chunks[{i}] (slot {chunk.slot}): positions up to {chunk.start_pos + n} exceed "
                    f"max_context={self.max_context}; load the model with a larger max_context"
                )
            if chunk.parents is not None:
                self._validate_tree(i, chunk)
            lo, hi = min(chunk.token_ids), max(chunk.token_ids)
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(
                    f"chunks[{i}] (slot {chunk.slot}): token id {lo if lo < 0 else hi} outside "
                    f"[0, {self.vocab_size})"
                )

    def _validate_tree(self, i: int, chunk: SlotChunk) -> None:
        if not self.supports_trees:
            raise ValueError(f"chunks[{i}] (slot {chunk.slot}): the {self.backend} backend verifies chains only "
                             f"(no parents)")
        parents = list(chunk.parents)
        if len(parents) != len(chunk.token_ids) or any(not -1 <= p < j for j, p in enumerate(parents)):
            raise ValueError(f"chunks[{i}] (slot {chunk.slot}): parents {parents} must hold one index per token, "
                             f"each in [-1, its own index)")

    def _commit_lengths(self, chunks: Sequence[SlotChunk]) -> None:
        for chunk in chunks:
            self._lengths[chunk.slot] = chunk.start_pos + len(chunk.token_ids)
            if self.kv is not None:
                self.kv.record(chunk.slot, chunk.start_pos, chunk.token_ids)
