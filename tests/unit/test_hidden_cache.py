"""The target's kept hidden rows of cached blocks (target_worker/hidden_cache.py): whole blocks only,
gathered over rounds, found by hash, bounded, started over on a re-prefill."""

from __future__ import annotations

import torch

from duospec.target_worker.hidden_cache import HiddenRowCache

BS = 4


def rows(start: int, end: int) -> torch.Tensor:
    """Row p holds p in every column: where a row came from shows in it."""
    return torch.arange(start, end, dtype=torch.float32).unsqueeze(1).repeat(1, 3)


def test_whole_blocks_are_kept_as_their_rows_arrive_and_read_back_by_position():
    cache = HiddenRowCache(BS, max_blocks=8)
    cache.observe(1, 0, rows(0, 6), [b"a"])  # block 0 whole, block 1 half
    assert len(cache) == 1 and cache.usable_blocks([b"a", b"b"]) == 1
    cache.observe(1, 6, rows(6, 7), [b"a"])  # block 1 not yet committed as a whole
    cache.observe(1, 7, rows(7, 9), [b"a", b"b"])
    assert cache.usable_blocks([b"a", b"b", b"c"]) == 2
    assert cache.rows([b"a", b"b"], 2, 7)[:, 0].tolist() == [2, 3, 4, 5, 6]
    assert cache.usable_blocks([b"x", b"a"]) == 0  # counted from the first block


def test_a_re_prefill_starts_over_and_the_least_recently_used_block_goes_first():
    cache = HiddenRowCache(BS, max_blocks=2)
    cache.observe(1, 0, rows(0, 3), [])
    cache.observe(1, 0, rows(100, 104), [b"p"])  # the sequence fed again from 0 (new rows win)
    assert cache.rows([b"p"], 0, 4)[:, 0].tolist() == [100, 101, 102, 103]
    cache.observe(2, 0, rows(0, 8), [b"q", b"r"])
    assert cache.usable_blocks([b"p"]) == 0 and cache.usable_blocks([b"q", b"r"]) == 2
    cache.rows([b"q"], 0, 4)  # q used: r is now the oldest
    cache.observe(3, 0, rows(0, 4), [b"s"])
    assert cache.usable_blocks([b"q"]) == 1 and cache.usable_blocks([b"r"]) == 0


def test_a_gap_is_not_filled_with_wrong_rows():
    cache = HiddenRowCache(BS, max_blocks=8)
    cache.observe(1, 0, rows(0, 2), [])
    cache.observe(1, 5, rows(5, 12), [b"a", b"b", b"c"])  # positions 2 .. 4 never arrived
    # block 1 (positions 4 .. 7) misses position 4: only block 2 is whole
    assert cache.usable_blocks([b"a"]) == cache.usable_blocks([b"b"]) == 0 and cache.usable_blocks([b"c"]) == 1
    assert cache.rows([b"a", b"b", b"c"], 8, 12)[:, 0].tolist() == [8, 9, 10, 11]
    cache.forget(1)
