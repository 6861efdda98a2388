"""Paged KV bookkeeping: a pool of fixed-size blocks, a block table per sequence, and the prefix cache.
Pure Python (no tensors): the runner (llama.py) turns what this decides into copies and indices.

Glossary:
    block        ``block_size`` consecutive KV positions of one sequence, stored anywhere in the pool.
    block table  a sequence's blocks in position order: position p lives in ``table[p // block_size]``
                 at offset ``p % block_size``. A table may hold blocks past the sequence's length
                 (rollback keeps them for the sequence's next tokens; they are never cached).
    refcount     how many tables hold a block. A block held by two tables (a branch's shared prefix,
                 a prefix-cache hit) is read-only: a write to it first copies it (copy-on-write).
    committed    positions the caller declared final (verified tokens): ``commit(slot, n)``. Only
                 full blocks of committed positions are hashed and offered to later sequences; draft
                 positions never are.
    block hash   blake2b over (the previous block's hash, the block's token ids); the first block's
                 "previous hash" is the sequence's salt (a tenant, or "" for a model-wide cache), so
                 equal hashes mean equal tokens from position 0 under the same salt.
    free queue   blocks no table holds, in eviction order: blocks that hold no cached prefix first,
                 then cached ones least recently used first. A cached block stays findable by its
                 hash until it is taken for new content (evicted).

Invariant: a block that is hashed or shared is never written in place; `prepare_writes` makes every
block a forward writes private first (unhash a private cached block, copy a shared one).
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from duospec.engine.errors import BlocksExhausted

__all__ = ["BlockPool", "BlockTables", "CacheStats", "chained_block_hashes", "salt_root"]


def _block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    # A cryptographic hash: a crafted collision would hand one tenant's KV to another's tokens.
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(b"".join(int(t).to_bytes(4, "little") for t in tokens))
    return digest.digest()


def chained_block_hashes(root: bytes, tokens: Sequence[int], block_size: int,
                         known: Sequence[bytes] = (), length: int | None = None) -> Iterator[bytes]:
    """The hashes of the full blocks of `tokens[:length]` (a sequence's tokens from position 0) past
    the `len(known)` blocks already hashed (`known`), each chained from the one before, the first
    from `root` (salt_root). Lazy: a lookup that misses stops hashing. (`length` rather than a
    slice: a commit every verify round must not copy the sequence's tokens.)"""
    parent = known[-1] if known else root
    end = len(tokens) if length is None else min(length, len(tokens))
    for i in range(len(known), end // block_size):
        parent = _block_hash(parent, tokens[i * block_size: (i + 1) * block_size])
        yield parent


def salt_root(salt: str) -> bytes:
    """The hash a sequence's first block chains from."""
    return hashlib.blake2b(b"duospec-prefix\x00" + salt.encode(), digest_size=16).digest()


class BlockPool:
    """``num_blocks`` block ids with refcounts, the free queue and the hash -> block map."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: must be >= 1")
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        # front = taken first; OrderedDict: O(1) removal of a cached block a hit brings back
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks a new write can take (cached ones included: they are evicted)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self.by_hash)

    def take(self, prefer: int | None = None) -> int:
        """A block for new content (refcount 1), evicting the cached prefix it held if any; `prefer`
        when that one is free and holds no cached prefix."""
        if not self._free:
            raise BlocksExhausted(f"all {self.num_blocks} KV blocks are in use")
        if prefer is not None and 0 <= prefer < self.num_blocks and self.refs[prefer] == 0 \
                and self.hash_of[prefer] is None:
            del self._free[prefer]
            block = prefer
        else:
            block, _ = self._free.popitem(last=False)
        if self.hash_of[block] is not None:
            self.unhash(block)
            self.evictions += 1
        self.refs[block] = 1
        return block

    def hold(self, block: int) -> None:
        """One more table holds `block` (a cached block no table held leaves the free queue)."""
        if self.refs[block] == 0:
            del self._free[block]
        self.refs[block] += 1

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free[block] = None
            if self.hash_of[block] is None:  # nothing worth keeping: taken before any cached block
                self._free.move_to_end(block, last=False)
        elif self.refs[block] < 0:
            raise RuntimeError(f"KV block {block} released more often than held")

    def cached(self, block_hash: bytes) -> int | None:
        return self.by_hash.get(block_hash)

    def publish(self, block: int, block_hash: bytes) -> None:
        """Offer `block` to later sequences under `block_hash` (a first block with that hash wins)."""
        if self.hash_of[block] is None and block_hash not in self.by_hash:
            self.hash_of[block] = block_hash
            self.by_hash[block_hash] = block

    def unhash(self, block: int) -> None:
        block_hash = self.hash_of[block]
        if block_hash is not None:
            self.hash_of[block] = None
            if self.by_hash.get(block_hash) == block:
                del self.by_hash[block_hash]


@dataclass
class _Table:
    root: bytes  # the salt's root hash
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # token id at each written cache index
    hashes: list[bytes] = field(default_factory=list)  # of blocks[:len(hashes)]: full, committed


@dataclass(frozen=True)
class CacheStats:
    num_blocks: int
    free_blocks: int  # not held by any sequence (cached prefixes included)
    cached_blocks: int  # findable by hash (held or not)
    queries: int  # prompt positions looked up in the prefix cache
    hits: int  # of those, positions served from it
    evictions: int  # cached blocks taken for new content
    block_size: int  # positions per block

    @property
    def usage(self) -> float:
        """Fraction of the pool held by sequences (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.free_blocks / self.num_blocks


class BlockTables:
    """Every sequence's block table over one pool; `prefix_caching` turns hashing and lookups on.

    Placement: slot s's block i goes to block ``s * home_blocks + i`` when that one is free (its
    "home": while the pool is not crowded a sequence's blocks lie in order and consecutive slots'
    tables are evenly spaced, so the runner reads them as a view, as a slot cache did), else to the
    block after its previous one, else to the head of the free queue."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True, home_blocks: int = 0):
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.home_blocks = home_blocks
        self._tables: dict[int, _Table] = {}
        self.queries = 0
        self.hits = 0

    # ---- sequences ---------------------------------------------------------------------------

    def open(self, slot: int, salt: str = "") -> None:
        self._tables[slot] = _Table(salt_root(salt))

    def close(self, slot: int) -> None:
        table = self._tables.pop(slot)
        # Last block first: a sequence's tail is the least likely part to be asked for again.
        for block in reversed(table.blocks):
            self.pool.release(block)

    def blocks(self, slot: int) -> list[int]:
        return self._tables[slot].blocks

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def truncate(self, slot: int, length: int) -> None:
        """The sequence now holds positions [0, length); later ones are neither committed nor valid
        (their blocks stay in the table for its next tokens)."""
        table = self._tables[slot]
        del table.hashes[length // self.block_size:]
        del table.tokens[length:]

    def fork(self, src: int, dst: int, length: int) -> list[tuple[int, int]]:
        """`dst` holds `src`'s positions [0, length): the same blocks, shared (no copy until a write) —
        or, where `dst` has a home region and the pool the blocks, copies in it (a batch of sequences
        at home is read as a view, worth the copy while memory is plentiful). Returns the (source,
        copy) block pairs whose contents the caller must copy."""
        source, old = self._tables[src], self._tables[dst]
        n = self.blocks_for(length)
        for block in reversed(old.blocks):
            self.pool.release(block)
        home = [self._home(dst, i) for i in range(n)]
        free_homes = all(b is not None and self.pool.refs[b] == 0 and self.pool.hash_of[b] is None for b in home)
        blocks = [self.pool.take(b) for b in home] if free_homes else source.blocks[:n]
        if not free_homes:
            for block in blocks:
                self.pool.hold(block)
        self._tables[dst] = _Table(source.root, blocks, source.tokens[:length],
                                   source.hashes[: length // self.block_size])
        return list(zip(source.blocks[:n], blocks)) if free_homes else []

    # ---- writes ------------------------------------------------------------------------------

    def blocks_needed(self, writes: Sequence[tuple[int, int, int]]) -> int:
        """New blocks that `prepare_writes(writes)` takes: (slot, start, end) = positions [start, end)."""
        bs, need = self.block_size, 0
        for slot, start, end in writes:
            blocks = self._tables[slot].blocks
            first, stop = start // bs, self.blocks_for(end)
            need += sum(self.pool.refs[b] > 1 for b in blocks[first:stop]) + max(0, stop - len(blocks))
        return need

    def prepare_writes(self, writes: Sequence[tuple[int, int, int]]) -> list[tuple[int, int]]:
        """Make every block that positions [start, end) of each (slot, start, end) fall in private and
        present; returns the (source, copy) block pairs whose contents the caller must copy before it
        writes. Raises BlocksExhausted, changing nothing, when the pool cannot supply the blocks."""
        need = self.blocks_needed(writes)
        if need > self.pool.num_free:
            self._trim_tails({slot for slot, _, _ in writes}, need)
        if need > self.pool.num_free:
            raise BlocksExhausted(
                f"the KV cache needs {need} more blocks of {self.block_size} positions but only "
                f"{self.pool.num_free} of {self.pool.num_blocks} are free")
        bs, copies = self.block_size, []
        # (copy -> the block it copies): the caller copies every pair at once (sources read before
        # any copy is written), so a copy of a block that is itself a copy made in this call — two
        # branches moved off their parent's home block, then one of them writing — must read the
        # original: the intermediate copy still holds stale rows when the copies run.
        origin: dict[int, int] = {}

        def copy(src: int, dst: int) -> None:
            origin[dst] = origin.get(src, src)
            copies.append((origin[dst], dst))

        for slot, start, end in writes:
            table = self._tables[slot]
            del table.hashes[start // bs:]
            for i in range(start // bs, self.blocks_for(end)):
                if i == len(table.blocks):
                    table.blocks.append(self.pool.take(self._placement(slot, table, i)))
                    continue
                block = table.blocks[i]
                if self.pool.refs[block] > 1 and block == self._home(slot, i):
                    copy(block, self._move_other_holders(slot, i, block))
                elif self.pool.refs[block] > 1:
                    table.blocks[i] = self.pool.take(self._placement(slot, table, i))
                    self.pool.release(block)
                    copy(block, table.blocks[i])
                else:
                    self.pool.unhash(block)
        return copies

    def _move_other_holders(self, slot: int, i: int, block: int) -> int:
        """Copy-on-write the other way round: `slot` keeps its home block (its reads stay a view) and
        the other tables holding it at index i move to the copy, which takes over its cached hash."""
        copy = self.pool.take()
        movers = [t for s, t in self._tables.items() if s != slot and i < len(t.blocks) and t.blocks[i] == block]
        for table in movers:
            table.blocks[i] = copy
            self.pool.release(block)
        for _ in movers[1:]:
            self.pool.hold(copy)
        block_hash = self.pool.hash_of[block]
        self.pool.unhash(block)
        if block_hash is not None:
            self.pool.publish(copy, block_hash)
        return copy

    def _home(self, slot: int, i: int) -> int | None:
        if self.home_blocks and i < self.home_blocks and (slot + 1) * self.home_blocks <= self.pool.num_blocks:
            return slot * self.home_blocks + i
        return None

    def _placement(self, slot: int, table: _Table, i: int) -> int | None:
        home = self._home(slot, i)
        if home is not None:
            return home
        return table.blocks[i - 1] + 1 if 0 < i <= len(table.blocks) else None

    def record(self, slot: int, start: int, token_ids: Sequence[int]) -> None:
        """The tokens written at cache indices start, start + 1, ... (for hashing them later)."""
        tokens = self._tables[slot].tokens
        del tokens[start:]
        tokens.extend(token_ids)

    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Cache index src[i]'s token moves to dst[i] (a tree's kept path; the caller moves the KV)."""
        table = self._tables[slot]
        moved = [table.tokens[s] for s in src]
        for d, token in zip(dst, moved):
            if self.pool.refs[table.blocks[d // self.block_size]] != 1:
                raise RuntimeError(f"keep_path would write a shared KV block at cache index {d}")
            table.tokens[d] = token

    def _trim_tails(self, keep: set[int], need: int) -> None:
        """Give back blocks wholly past other sequences' lengths until `need` are free."""
        for slot, table in self._tables.items():
            if self.pool.num_free >= need:
                return
            if slot in keep:
                continue
            used = self.blocks_for(len(table.tokens))
            while len(table.blocks) > used:
                self.pool.release(table.blocks.pop())

    # ---- prefix cache ------------------------------------------------------------------------

    def commit(self, slot: int, length: int) -> None:
        """Positions [0, length) hold verified tokens: hash and publish their full blocks."""
        if not self.prefix_caching:
            return
        table = self._tables[slot]
        for block_hash in self._next_hashes(table.root, table.hashes, table.tokens, length):
            self.pool.publish(table.blocks[len(table.hashes)], block_hash)
            table.hashes.append(block_hash)

    def hashes(self, slot: int) -> Sequence[bytes]:
        """The hashes of the slot's committed full blocks, in position order: the table's own list
        (read every verify round, so not copied), to read, never to change."""
        return self._tables[slot].hashes

    def chain(self, slot: int, start: int, token_ids: Sequence[int]) -> Iterator[bytes]:
        """The hashes the slot's full blocks would have with `token_ids` following its positions
        [0, start) — what `match` looks up — lazily, changing nothing."""
        table = self._tables[slot]
        hashes = table.hashes[: start // self.block_size]
        return itertools.chain(hashes, self._next_hashes(table.root, hashes, table.tokens[:start] + list(token_ids)))

    def _next_hashes(self, root: bytes, hashes: list[bytes], tokens: Sequence[int],
                     length: int | None = None) -> Iterator[bytes]:
        return chained_block_hashes(root, tokens, self.block_size, hashes, length)

    def match(self, slot: int, start: int, token_ids: Sequence[int]) -> int:
        """The slot holds verified tokens at [0, start) and `token_ids` (verified too) follow. Adopt
        cached blocks for as many of them as possible, leaving at least the last token to compute
        (its logits are wanted); returns where computing must start (>= start)."""
        self.commit(slot, start)
        if not self.prefix_caching:
            return start
        table, bs = self._tables[slot], self.block_size
        self.queries += len(token_ids)
        known = table.tokens[:start] + list(token_ids)
        # blocks of known[:-1] only: the last token is always computed
        for block_hash in self._next_hashes(table.root, table.hashes, known, len(known) - 1):
            block = self.pool.cached(block_hash)
            if block is None:
                break
            self.pool.hold(block)
            i = len(table.hashes)
            if i < len(table.blocks):
                self.pool.release(table.blocks[i])
                table.blocks[i] = block
            else:
                table.blocks.append(block)
            table.hashes.append(block_hash)
        reached = len(table.hashes) * bs
        if reached <= start:
            return start
        self.hits += reached - start
        table.tokens[:] = known[:reached]
        return reached

    def stats(self) -> CacheStats:
        return CacheStats(num_blocks=self.pool.num_blocks, free_blocks=self.pool.num_free,
                          cached_blocks=self.pool.num_cached, queries=self.queries, hits=self.hits,
                          evictions=self.pool.evictions, block_size=self.block_size)
