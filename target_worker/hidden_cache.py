"""The target's final hidden states of its prefix-cached blocks, so that a sequence whose drafter is a
head (EAGLE, Medusa: it drafts from the hidden states each verdict carries) can take cached KV too.

A prefix-cache hit skips the forward over the cached positions, and with it their hidden states;
without them a head's sequence could not use the cache at all. So the verifier keeps, next to the
KV pool, the hidden rows (float16, as they travel) of every full committed block a head's sequence
wrote, keyed by the block's hash — the same salted chain of token ids that finds the KV block, so
rows are found for exactly the tokens (and the tenant) they were computed for. A hit is then taken
only as far as both the KV and the rows are cached, and the verdict sends the cached rows as it
would have sent computed ones.

Cost: hidden_size × 2 bytes a position (SmolLM2-135M: 1.1 KB against 45 KB of KV), at most one
block's rows per KV block, least recently used dropped first. A row set can outlive its KV block or
the reverse; either way the hit stops at the first block that lacks one of them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch


class HiddenRowCache:
    def __init__(self, block_size: int, max_blocks: int) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # block hash -> [block_size, hidden] fp16
        # seq_id -> (position of row 0, rows of committed positions not yet stored as a whole block)
        self._pending: dict[int, tuple[int, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def usable_blocks(self, hashes: Iterable[bytes]) -> int:
        """How many of `hashes` (consecutive blocks), from the first, have their rows here (read only
        as far as the first that has none)."""
        n = 0
        for block_hash in hashes:
            if block_hash not in self._rows:
                break
            n += 1
        return n

    def rows(self, hashes: Sequence[bytes], start: int, end: int) -> torch.Tensor:
        """Rows of positions [start, end) from the blocks `hashes` (block i holds positions
        i * block_size ...); each block read counts as a use."""
        bs = self.block_size
        first, last = start // bs, -(-end // bs)
        blocks = []
        for block_hash in hashes[first:last]:
            self._rows.move_to_end(block_hash)
            blocks.append(self._rows[block_hash])
        return torch.cat(blocks)[start - first * bs: end - first * bs]

    def observe(self, seq_id: int, start: int, rows: torch.Tensor, hashes: Sequence[bytes]) -> None:
        """`rows`: the sequence's committed positions [start, start + len(rows)), as sent; `hashes`:
        its committed full blocks' hashes now. Stores every full block whose rows are all known."""
        rows = rows.detach().to(torch.float16).cpu()
        base, pending = self._pending.get(seq_id, (start, rows[:0]))
        if start < base or start > base + len(pending):  # a re-prefill, or a gap: start over from here
            base, pending = start, rows[:0]
        pending = torch.cat([pending[: start - base], rows])
        bs = self.block_size
        first = -(-base // bs)  # the first block whose rows may all be here
        cut = min(first * bs - base, len(pending))  # rows of a block begun before `base` never make a whole one
        for i in range(first, len(hashes)):
            lo, hi = i * bs - base, (i + 1) * bs - base
            if hi > len(pending):
                break
            if hashes[i] not in self._rows:
                self._rows[hashes[i]] = pending[lo:hi].clone()
                if len(self._rows) > self.max_blocks:
                    self._rows.popitem(last=False)
            cut = hi
        self._pending[seq_id] = (base + cut, pending[cut:])

    def forget(self, seq_id: int) -> None:
        self._pending.pop(seq_id, None)
