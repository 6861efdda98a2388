"""The paged KV cache's bookkeeping (duospec/engine/blocks.py), without a model: refcounts and
copy-on-write, the free queue's eviction order, the prefix cache's hash chain and salt, what is and is
not cached, and a pool that never leaks."""

from __future__ import annotations

import random

import pytest

from duospec.engine.blocks import BlockPool, BlockTables
from duospec.engine.errors import BlocksExhausted, SlotsExhausted

BS = 4


def write(tables: BlockTables, slot: int, start: int, tokens: list[int]) -> list[tuple[int, int]]:
    """What a forward does to the tables: make the blocks writable, then record the tokens."""
    copies = tables.prepare_writes([(slot, start, start + len(tokens))])
    tables.record(slot, start, tokens)
    return copies


def test_a_sequence_takes_blocks_as_it_grows_and_gives_them_back():
    tables = BlockTables(10, BS)
    tables.open(0)
    assert tables.blocks(0) == [] and tables.pool.num_free == 10  # an open sequence costs nothing
    write(tables, 0, 0, list(range(5)))
    assert len(tables.blocks(0)) == 2 and tables.pool.num_free == 8
    write(tables, 0, 5, [7, 8, 9])  # fills block 1 exactly: no new block
    assert len(tables.blocks(0)) == 2
    tables.close(0)
    assert tables.pool.num_free == 10


def test_rollback_keeps_the_blocks_for_the_sequence():
    tables = BlockTables(10, BS)
    tables.open(0)
    write(tables, 0, 0, list(range(11)))
    blocks = list(tables.blocks(0))
    tables.truncate(0, 3)  # rollback is a length: the blocks stay
    assert tables.blocks(0) == blocks
    write(tables, 0, 3, list(range(8)))  # re-extension reuses them
    assert tables.blocks(0) == blocks and tables.pool.num_free == 7


def test_a_branch_shares_blocks_and_copies_one_only_when_written():
    tables = BlockTables(10, BS)
    tables.open(0)
    tables.open(1)
    write(tables, 0, 0, list(range(10)))  # blocks a, b, c (c partial)
    a, b, c = tables.blocks(0)
    tables.fork(0, 1, 10)
    assert tables.blocks(1) == [a, b, c] and tables.pool.num_free == 7
    assert [tables.pool.refs[x] for x in (a, b, c)] == [2, 2, 2]
    copies = write(tables, 1, 10, [99])  # the branch writes into the shared partial block: its own copy
    assert copies == [(c, tables.blocks(1)[2])] and tables.blocks(1)[:2] == [a, b]
    assert tables.pool.refs[c] == 1 and tables.pool.num_free == 6
    assert write(tables, 0, 10, [42]) == []  # the parent's block is its own again: written in place
    tables.close(1)
    tables.close(0)
    assert tables.pool.num_free == 10 and all(r == 0 for r in tables.pool.refs)


def test_running_out_raises_and_changes_nothing():
    tables = BlockTables(3, BS)
    tables.open(0)
    tables.open(1)
    write(tables, 0, 0, list(range(8)))
    with pytest.raises(BlocksExhausted, match=r"needs 2 more blocks of 4 positions but only 1 of 3 are free") as info:
        tables.prepare_writes([(1, 0, 8)])
    assert isinstance(info.value, SlotsExhausted)  # callers that handle "no room" handle this too
    assert tables.blocks(1) == [] and tables.pool.num_free == 1


def test_a_short_pool_takes_back_blocks_past_other_sequences_lengths():
    tables = BlockTables(4, BS)
    tables.open(0)
    tables.open(1)
    write(tables, 0, 0, list(range(12)))
    tables.truncate(0, 5)  # holds 3 blocks, needs 2
    write(tables, 1, 0, list(range(8)))  # 2 blocks: 1 free + 1 taken back from sequence 0's tail
    assert len(tables.blocks(0)) == 2 and tables.pool.num_free == 0


def test_only_committed_full_blocks_are_cached_and_found():
    tables = BlockTables(16, BS)
    tables.open(0)
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks
    write(tables, 0, 0, prompt + [1, 2, 3, 4, 5])  # the prompt and 5 draft tokens
    assert tables.stats().cached_blocks == 0  # nothing is cached before it is committed
    tables.commit(0, len(prompt))
    assert tables.stats().cached_blocks == 2  # the third block holds drafts: never cached
    tables.open(1)
    assert tables.match(1, 0, prompt + [7]) == 8
    assert tables.blocks(1) == tables.blocks(0)[:2]
    # at least the last token is computed, even when every block is cached
    tables.open(2)
    assert tables.match(2, 0, prompt[:8]) == 4
    stats = tables.stats()
    assert (stats.queries, stats.hits) == (12 + 8, 8 + 4)


def test_a_prefix_hit_needs_the_same_tokens_from_position_0_and_the_same_salt():
    tables = BlockTables(16, BS)
    tables.open(0, salt="tenant-a")
    tokens = list(range(200, 213))
    write(tables, 0, 0, tokens)
    tables.commit(0, 13)
    for slot, salt, probe, want in [(1, "tenant-a", tokens, 12), (2, "tenant-b", tokens, 0),
                                    (3, "tenant-a", [9] + tokens[1:], 0), (4, "tenant-a", tokens[:5] + [9] + tokens[6:], 4)]:
        tables.open(slot, salt=salt)
        assert tables.match(slot, 0, probe) == want, salt


def test_a_write_into_a_cached_block_copies_it_first():
    tables = BlockTables(8, BS)
    tables.open(0)
    write(tables, 0, 0, list(range(8)))
    tables.commit(0, 8)
    tables.open(1)
    assert tables.match(1, 0, list(range(8)) + [50]) == 8
    shared = tables.blocks(1)[1]
    tables.truncate(1, 6)  # the sequence rolls back into a shared cached block and rewrites it
    copies = write(tables, 1, 6, [60, 61])
    assert copies == [(shared, tables.blocks(1)[1])]
    tables.open(2)
    assert tables.match(2, 0, list(range(8)) + [50]) == 8  # the cached content is intact
    assert tables.blocks(2)[1] == shared


def test_a_private_cached_block_that_is_rewritten_leaves_the_cache():
    tables = BlockTables(8, BS)
    tables.open(0)
    write(tables, 0, 0, list(range(8)))
    tables.commit(0, 8)
    tables.truncate(0, 6)
    assert write(tables, 0, 6, [60, 61]) == []  # held by this sequence alone: rewritten in place
    tables.open(1)
    assert tables.match(1, 0, list(range(8)) + [50]) == 4  # the second block's old content is gone


def test_eviction_takes_plain_blocks_first_then_the_least_recently_used_cached_ones():
    pool = BlockPool(4)
    a, b, c, d = (pool.take() for _ in range(4))
    for block, key in ((a, b"a"), (b, b"b")):
        pool.publish(block, key)
    for block in (a, c, b, d):
        pool.release(block)
    # d and c hold nothing worth keeping; a was freed before b
    assert [pool.take() for _ in range(4)] == [d, c, a, b]
    assert pool.cached(b"a") is None and pool.cached(b"b") is None and pool.evictions == 2


def test_a_cache_hit_brings_a_free_block_back():
    pool = BlockPool(2)
    a = pool.take()
    pool.publish(a, b"k")
    pool.release(a)
    assert pool.num_free == 2
    pool.hold(pool.cached(b"k"))
    assert pool.num_free == 1 and pool.take() != a


def test_the_pool_never_leaks_through_a_random_soak():
    rng = random.Random(7)
    tables = BlockTables(40, BS)
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(1, 20))] for _ in range(6)]
    live: dict[int, int] = {}  # slot -> length
    next_slot = 0
    for _ in range(2000):
        action = rng.random()
        if action < 0.15 or not live:
            slot, next_slot = next_slot, next_slot + 1
            tables.open(slot, salt=rng.choice(["", "t1"]))
            prompt = rng.choice(prompts)
            start = tables.match(slot, 0, prompt)
            try:
                write(tables, slot, start, prompt[start:])
                live[slot] = len(prompt)
            except BlocksExhausted:
                tables.close(slot)
        elif action < 0.3:
            slot = rng.choice(list(live))
            tables.close(slot)
            del live[slot]
        elif action < 0.4:
            src = rng.choice(list(live))
            slot, next_slot = next_slot, next_slot + 1
            tables.open(slot)
            length = rng.randrange(live[src] + 1)
            tables.fork(src, slot, length)
            live[slot] = length
        else:
            slot = rng.choice(list(live))
            start = rng.randrange(max(0, live[slot] - 3), live[slot] + 1)
            tables.truncate(slot, start)
            live[slot] = start
            try:
                write(tables, slot, start, [rng.randrange(50) for _ in range(rng.randrange(1, 6))])
                live[slot] = len(tables._tables[slot].tokens)
            except BlocksExhausted:
                pass
            if rng.random() < 0.5:
                tables.commit(slot, live[slot])
        held = sum(len(tables.blocks(s)) for s in live)
        assert sum(tables.pool.refs) == held
    for slot in list(live):
        tables.close(slot)
    assert tables.pool.num_free == 40 and not any(tables.pool.refs)


def test_a_sequence_keeps_its_home_blocks_when_a_branch_shares_them():
    """A pool laid out like a slot cache (home regions of 4 blocks for slots 0-3): a branch into a slot
    with a free home gets copies there; one into a slot without a home shares, and when the owner
    writes into a shared block the branch moves to the copy, the owner's blocks staying in order."""
    tables = BlockTables(16, BS, home_blocks=4)
    for slot in (1, 2, 4):
        tables.open(slot)
    write(tables, 1, 0, list(range(10)))
    assert tables.blocks(1) == [4, 5, 6]
    tables.commit(1, 8)
    assert tables.fork(1, 2, 10) == [(4, 8), (5, 9), (6, 10)] and tables.blocks(2) == [8, 9, 10]
    assert tables.fork(1, 4, 10) == [] and tables.blocks(4) == [4, 5, 6]  # no home: shared
    copies = write(tables, 1, 9, [99, 100])  # the owner rewrites position 9 in the shared block 6
    assert tables.blocks(1) == [4, 5, 6] and copies == [(6, tables.blocks(4)[2])] and tables.blocks(4)[:2] == [4, 5]
    assert tables.pool.refs[6] == 1 and tables.pool.refs[tables.blocks(4)[2]] == 1
    tables.truncate(1, 4)
    write(tables, 1, 4, [7, 7])  # a cached block shared by the branch: the cache entry moves with the copy
    assert tables.blocks(1)[1] == 5 and tables.blocks(4)[1] != 5
    tables.open(3)
    assert tables.match(3, 0, list(range(10))) == 8 and tables.blocks(3)[:2] == [4, tables.blocks(4)[1]]


class _Rows:
    """A pool's contents as the runner keeps them: block b's rows hold the tokens written there.
    `copy` runs a write's (source, copy) pairs the way the runner does — every source read before any
    copy is written (one gather, one scatter)."""

    def __init__(self, num_blocks: int):
        self.rows = [[None] * BS for _ in range(num_blocks)]

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        read = [list(self.rows[src]) for src, _ in pairs]
        for (_, dst), rows in zip(pairs, read):
            self.rows[dst] = rows

    def write(self, tables: BlockTables, writes: list[tuple[int, int, list[int]]]) -> None:
        """One batched forward: the writes' blocks made private, the copies run, then the tokens land."""
        self.copy(tables.prepare_writes([(slot, start, start + len(tokens)) for slot, start, tokens in writes]))
        for slot, start, tokens in writes:
            tables.record(slot, start, tokens)
            for pos, token in enumerate(tokens, start):
                self.rows[tables.blocks(slot)[pos // BS]][pos % BS] = token

    def read(self, tables: BlockTables, slot: int) -> list[int]:
        n = len(tables._tables[slot].tokens)
        return [self.rows[tables.blocks(slot)[pos // BS]][pos % BS] for pos in range(n)]


def test_branches_moved_off_a_home_block_and_written_in_the_same_batch_read_their_parents_rows():
    """The drafter's case: a sequence at home and two hedges sharing its last block, all three writing
    in one forward. The owner's write moves both hedges to one copy, and the first hedge's write then
    copies that copy — which must be filled from the owner's block, not from the copy's stale rows."""
    tables, pool = BlockTables(16, BS, home_blocks=4), _Rows(16)
    for slot in (1, 2):  # their home blocks hold cached prefixes: a branch into them shares instead
        tables.open(slot)
        pool.write(tables, [(slot, 0, [100 * slot + i for i in range(16)])])
        tables.commit(slot, 16)
        tables.close(slot)
    tables.open(0)
    pool.write(tables, [(0, 0, list(range(6)))])
    for slot in (1, 2):
        tables.open(slot)
        assert tables.fork(0, slot, 6) == [] and tables.blocks(slot) == tables.blocks(0)  # shared
    pool.write(tables, [(0, 6, [60]), (1, 6, [61]), (2, 6, [62])])
    assert pool.read(tables, 0) == [0, 1, 2, 3, 4, 5, 60]
    assert pool.read(tables, 1) == [0, 1, 2, 3, 4, 5, 61]
    assert pool.read(tables, 2) == [0, 1, 2, 3, 4, 5, 62]


def test_every_sequence_reads_what_it_wrote_through_a_random_soak_of_batched_writes_and_branches():
    """Sequences at home and branches of them (the drafter's hedges) writing in batches, rolling back,
    closing, prefix hits: after every batch each live sequence's rows hold exactly its tokens. (Before
    copies were resolved to their originals, 2 of these 40 seeds read stale rows.)"""
    for seed in range(40):
        _soak_batched_writes(random.Random(seed))


def _soak_batched_writes(rng: random.Random) -> None:
    tables, pool = BlockTables(64, BS, home_blocks=4), _Rows(64)
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(2, 14))] for _ in range(4)]
    live: set[int] = set()
    for _ in range(400):
        free = [s for s in range(16) if s not in live]
        action = rng.random()
        if free and (action < 0.15 or not live):
            slot = rng.choice(free)
            tables.open(slot)
            prompt = rng.choice(prompts)
            start = tables.match(slot, 0, prompt)
            try:
                pool.write(tables, [(slot, start, prompt[start:])])
                tables.commit(slot, len(prompt))  # cached prompts fill the home blocks: branches share
                live.add(slot)
            except BlocksExhausted:
                tables.close(slot)
        elif free and action < 0.4:
            src, slot = rng.choice(sorted(live)), rng.choice(free)
            tables.open(slot)
            length = len(tables._tables[src].tokens)
            pool.copy(tables.fork(src, slot, length if rng.random() < 0.5 else rng.randrange(length + 1)))
            live.add(slot)
        elif action < 0.5 and len(live) > 1:
            slot = rng.choice(sorted(live))
            tables.close(slot)
            live.discard(slot)
        else:  # one batched forward: some sequences roll back a little, each writes a few tokens
            writes = []
            for slot in rng.sample(sorted(live), rng.randint(1, len(live))):
                length = len(tables._tables[slot].tokens)
                start = rng.randrange(max(0, length - 2), length + 1)
                tables.truncate(slot, start)
                writes.append((slot, start, [rng.randrange(50) for _ in range(rng.randint(1, 3))]))
            try:
                pool.write(tables, writes)
            except BlocksExhausted:
                continue
            for slot, start, tokens in writes:
                tables.commit(slot, start + len(tokens) - 1)
        for slot in live:
            assert pool.read(tables, slot) == tables._tables[slot].tokens
