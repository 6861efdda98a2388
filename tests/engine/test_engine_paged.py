"""The lean engine over a paged KV cache: parity with transformers when every sequence's blocks are
scattered over the pool (prefills, ragged steps, rollbacks onto and across block boundaries, branches
that share blocks, sliding windows), the prefix cache (a hit changes no logit beyond the engine's
parity tolerance, draft positions are never cached), running out of blocks, and the pool's size."""

from __future__ import annotations

import pytest
import torch

from duospec.engine import BlocksExhausted, CheckpointError, SlotChunk, load_model
from duospec.engine.loader import KVOptions
from test_engine import CONFIGS, assert_close, chunk, drive_scenario, reference_logits
from test_engine import ckpt_dirs as ckpts  # noqa: F401  (fixtures)
from test_engine import sequences as seqs  # noqa: F401
from tiny_models import scattered_runner

BLOCK = 4


def in_order(blocks: list[int]) -> bool:
    return blocks == list(range(blocks[0], blocks[0] + len(blocks)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_scattered_blocks_match_transformers(name, ckpts, seqs):
    runner = scattered_runner(ckpts[name], max_context=64, blocks=60, block_size=BLOCK)
    assert runner.backend == "lean" and runner.cache_stats().num_blocks == 60
    drive_scenario(runner, seqs, reference_logits(ckpts[name], seqs))
    tables = [runner.kv.blocks(slot) for slot in range(3)]
    assert not all(in_order(t) for t in tables), tables  # the scenario really ran on scattered blocks
    for slot in range(3):
        runner.free_slot(slot)
    assert runner.cache_stats().free_blocks == 60


@pytest.mark.parametrize("name", ["llama", "mistral-window"])
def test_rollbacks_onto_and_across_block_boundaries(name, ckpts, seqs):
    runner = scattered_runner(ckpts[name], max_context=64, blocks=40, block_size=BLOCK)
    ref = reference_logits(ckpts[name], seqs)
    slot = runner.allocate_slot()
    runner.forward([chunk(slot, seqs[0], 0, 13)])
    # each rollback: write garbage past `keep`, roll back to it, re-extend with the true tokens
    for keep, garbage in ((12, 5), (8, 4), (9, 7), (16, 1), (15, 9)):
        end = runner.slot_length(slot)
        runner.forward([chunk(slot, seqs[0], min(end, keep), keep)] if end < keep else [SlotChunk(slot, keep, [7] * garbage)])
        runner.truncate(slot, keep)
        got = runner.forward([chunk(slot, seqs[0], keep, keep + 6)])[0]
        assert_close(got, ref[0, keep: keep + 6], f"re-extended after a rollback to {keep}")


def test_a_branch_shares_its_prefix_and_copies_a_block_only_when_it_writes(ckpts, seqs):
    runner = scattered_runner(ckpts["llama"], max_context=64, blocks=40, block_size=BLOCK)
    ref = reference_logits(ckpts["llama"], seqs)
    # seqs[1] with seqs[0]'s first 10 tokens: a branch of seqs[0] at position 10
    other = torch.cat([seqs[0, :10], seqs[1, 10:]])
    want_other = reference_logits_of(ckpts["llama"], other)
    main = runner.allocate_slot()
    runner.forward([chunk(main, seqs[0], 0, 14)])
    free = runner.cache_stats().free_blocks
    branch = runner.allocate_slot()
    runner.copy_prefix(main, branch, 10)
    assert runner.cache_stats().free_blocks == free  # nothing copied yet
    got = runner.forward([chunk(branch, other, 10, 20), chunk(main, seqs[0], 14, 20)])
    assert_close(got[0], want_other[10:20], "the branch")
    assert_close(got[1], ref[0, 14:20], "the main line after its branch wrote")
    assert runner.kv.blocks(branch)[:2] == runner.kv.blocks(main)[:2]  # full blocks stay shared
    runner.free_slot(main)
    got = runner.forward([chunk(branch, other, 20, 30)])[0]
    assert_close(got, want_other[20:30], "the branch after the main line was freed")


def test_two_branches_of_a_sequence_at_home_and_the_sequence_write_in_one_forward(ckpts, seqs):
    """The drafter's hedges: a pool laid out like a slot cache (a home region per slot), the branches'
    own homes holding cached prefixes so they share the sequence's blocks, and the sequence and both
    branches writing into the shared block in one forward. Each branch must read the sequence's rows
    before its branch point (a copy of a copy made in the same forward once read stale rows)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(ckpts["llama"]))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    block_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4 * BLOCK
    runner = load_model(ckpts["llama"], device="cpu", dtype=torch.float32, max_slots=4, max_context=16,
                        kv=KVOptions(block_size=BLOCK, kv_cache_memory_bytes=16 * block_bytes))
    assert runner.kv.home_blocks == 4
    main, fillers = runner.allocate_slot(), [runner.allocate_slot(), runner.allocate_slot()]
    for filler, tokens in zip(fillers, (seqs[1], seqs[2])):  # the branches' homes: cached other text
        runner.forward([chunk(filler, tokens, 0, 16)])
        runner.commit(filler, 16)
        runner.free_slot(filler)
    runner.forward([chunk(main, seqs[0], 0, 10)])
    branches = [runner.allocate_slot(), runner.allocate_slot()]
    assert sorted(branches) == sorted(fillers)
    for branch in branches:
        runner.copy_prefix(main, branch, 10)
        assert runner.kv.blocks(branch) == runner.kv.blocks(main)  # shared, not copied
    texts = [torch.cat([seqs[0, :10], torch.tensor([5 + i, 9, 11])]) for i in range(2)]
    got = runner.forward([chunk(main, seqs[0], 10, 13)] + [chunk(b, t, 10, 13) for b, t in zip(branches, texts)])
    assert_close(got[0], reference_logits(ckpts["llama"], seqs)[0, 10:13], "the sequence")
    for i, text in enumerate(texts):
        assert_close(got[1 + i], reference_logits_of(ckpts["llama"], text)[10:13], f"branch {i}")


def reference_logits_of(path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens[None]).logits[0]


@pytest.mark.parametrize("name", ["llama", "qwen2-tied", "mistral-window"])
def test_a_prefix_cache_hit_leaves_the_logits_as_they_were(name, ckpts, seqs):
    """B = A's first 26 tokens, then its own. With A's blocks cached B computes from position 24 and its
    logits equal those of the same engine without the cache."""
    b_tokens = torch.cat([seqs[0, :26], seqs[1, 26:]])
    plain = scattered_runner(ckpts[name], max_context=64, blocks=40, block_size=BLOCK)
    slot = plain.allocate_slot()
    want = plain.forward([chunk(slot, b_tokens, 0, 40)])[0]

    runner = scattered_runner(ckpts[name], max_context=64, blocks=40, block_size=BLOCK)
    a = runner.allocate_slot()
    runner.forward([chunk(a, seqs[0], 0, 30)])  # A's prompt: 26 verified tokens, then 4 drafts
    runner.commit(a, 26)
    assert runner.cache_stats().cached_blocks == 6  # 26 // 4: the drafts' block is not cached
    b = runner.allocate_slot()
    start = runner.match_prefix(b, 0, b_tokens[:40].tolist())
    assert start == 24 and runner.slot_length(b) == 24
    assert runner.kv.blocks(b)[:6] == runner.kv.blocks(a)[:6]
    got = runner.forward([chunk(b, b_tokens, start, 40)])[0]
    assert_close(got, want[24:], "after a prefix-cache hit")
    assert torch.equal(got.argmax(-1), want[24:].argmax(-1))
    stats = runner.cache_stats()
    assert (stats.queries, stats.hits) == (40, 24)
    assert_close(got, reference_logits_of(ckpts[name], b_tokens[:40])[24:], "against transformers")


def test_a_cached_prefix_survives_its_sequence_and_is_evicted_last(ckpts, seqs):
    runner = scattered_runner(ckpts["llama"], max_context=80, blocks=24, block_size=BLOCK)
    a = runner.allocate_slot("tenant-a")
    runner.forward([chunk(a, seqs[0], 0, 16)])
    runner.commit(a, 16)
    runner.free_slot(a)
    assert runner.cache_stats().free_blocks == 24 and runner.cache_stats().cached_blocks == 4
    filler = runner.allocate_slot()
    runner.forward([SlotChunk(filler, 0, seqs[1, :40].tolist() + [5] * 40)])  # 20 blocks: the uncached ones
    runner.free_slot(filler)
    assert runner.cache_stats().cached_blocks == 4
    other = runner.allocate_slot("tenant-b")
    assert runner.match_prefix(other, 0, seqs[0, :20].tolist()) == 0  # another salt: no hit
    b = runner.allocate_slot("tenant-a")
    assert runner.match_prefix(b, 0, seqs[0, :20].tolist()) == 16


def test_running_out_of_blocks_raises_and_changes_nothing(ckpts, seqs):
    runner = scattered_runner(ckpts["llama"], max_context=64, blocks=20, block_size=BLOCK)
    ref = reference_logits(ckpts["llama"], seqs)
    a, b = runner.allocate_slot(), runner.allocate_slot()
    runner.forward([chunk(a, seqs[0], 0, 48)])  # 12 of 20 blocks
    with pytest.raises(BlocksExhausted, match="needs 10 more blocks of 4 positions but only 8 of 20 are free"):
        runner.forward([chunk(b, seqs[1], 0, 40), chunk(a, seqs[0], 48 - 1, 48)])
    assert runner.slot_length(a) == 48 and runner.slot_length(b) == 0
    runner.truncate(a, 20)  # rollback keeps a's blocks; a short pool takes back those past its length
    got = runner.forward([chunk(b, seqs[1], 0, 40)])[0]
    assert_close(got, ref[1, :40], "after blocks past another sequence's length were taken back")
    assert_close(runner.forward([chunk(a, seqs[0], 20, 30)])[0], ref[0, 20:30], "the shortened sequence")


def test_the_pool_is_sized_by_memory(ckpts):
    path = ckpts["llama"]
    # 2 layers x 2 kv heads x head_dim 16 x K and V x 4 bytes = 512 bytes per position
    runner = load_model(path, max_slots=4, max_context=64, kv=KVOptions(kv_cache_memory_bytes=512 * 16 * 10 + 100))
    assert runner.cache_stats().num_blocks == 10 and runner.block_size == 16
    default = load_model(path, max_slots=3, max_context=64)  # no memory setting: 3 sequences x 64 positions
    assert default.cache_stats().num_blocks == 3 * 4
    with pytest.raises(CheckpointError, match=r"holds 3 blocks of 16 positions, but one request of max_model_len=64 "
                                              r"needs 4 .*raise models\[\]\.kv_cache_memory_bytes"):
        load_model(path, max_slots=4, max_context=64, kv=KVOptions(kv_cache_memory_bytes=512 * 16 * 3))
    with pytest.raises(CheckpointError, match=r"needs .* GiB but .* GiB is free"):
        load_model(path, max_slots=4, max_context=64, kv=KVOptions(kv_cache_memory_bytes=1 << 60))


def test_prefix_caching_off_caches_nothing(ckpts, seqs):
    runner = load_model(ckpts["llama"], max_slots=2, max_context=64, kv=KVOptions(prefix_caching=False))
    a = runner.allocate_slot()
    runner.forward([chunk(a, seqs[0], 0, 40)])
    runner.commit(a, 40)
    b = runner.allocate_slot()
    assert runner.match_prefix(b, 0, seqs[0, :40].tolist()) == 0
    assert runner.cache_stats().cached_blocks == 0
