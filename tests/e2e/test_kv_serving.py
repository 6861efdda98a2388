"""The paged KV cache through a real gRPC server (in-process coordinator): more concurrent requests than
the target's pool holds at their full length are preempted and resumed by recompute, and every one
finishes with the target's own greedy output; a cached prompt costs neither worker its prefill; after
a soak of finished, cancelled, failed and preempted requests both workers' pools hold nothing again."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from duospec.coordinator.config import ModelConfig
from duospec.coordinator.local import LocalCoordinator
from duospec.engine import load_model
from duospec.engine.loader import KVOptions
from duospec.v1 import generation_pb2 as pb
from server_support import collect, running_server, wait_until_nothing_held
from tiny_models import make_tiny_checkpoint
from exactness import hf_greedy, reference_model

MODEL = "kv"
CONTEXT = 256
BLOCK = 16
# tiny target: 2 layers x 2 kv heads x head_dim 16 x K and V x 4 bytes = 512 bytes per position
TARGET_POSITION_BYTES = 512
# tiny draft (hidden 32, 4 heads of 8, 2 kv heads, 1 layer): 128 bytes per position
DRAFT_POSITION_BYTES = 128


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-serving")
    target = make_tiny_checkpoint(root / "target", "llama", seed=21, max_position_embeddings=CONTEXT)
    draft = make_tiny_checkpoint(root / "draft", "llama", seed=22, hidden_size=32, num_layers=1,
                                 max_position_embeddings=CONTEXT)
    return target, draft


def coordinator(pair, target_blocks: int, draft_blocks: int, **config) -> LocalCoordinator:
    """The tiny pair with KV pools of the given sizes (in 16-position blocks) and up to 8 live sequences."""
    target, draft = pair
    config = ModelConfig(name=MODEL, target=str(target), draft=str(draft), device="cpu", dtype="float32",
                         max_num_seqs=8, max_batch_size=8, **config)
    runners = [load_model(path, dtype="float32", max_slots=8, max_context=CONTEXT,
                          kv=KVOptions(kv_cache_memory_bytes=blocks * BLOCK * position))
               for path, blocks, position in ((target, target_blocks, TARGET_POSITION_BYTES),
                                              (draft, draft_blocks, DRAFT_POSITION_BYTES))]
    return LocalCoordinator([config], runners={MODEL: tuple(runners)})


@pytest.fixture(scope="module")
def reference(pair):
    """transformers' model of the tiny target (one per module: the references are memoized by model)."""
    return reference_model(pair[0])


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 380, (length,), generator=gen).tolist() for _ in range(n)]


def greedy_request(prompt: list[int], n: int, mode=pb.SPECULATION_MODE_PEARL) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt),
                              stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True),
                              speculation=pb.SpeculationParams(mode=mode))


def tokens(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]


async def pools(coord: LocalCoordinator):
    scheduler = await coord.entries[MODEL].get_scheduler()
    target, draft = scheduler.workers
    return scheduler, target.verifier.runner, draft.loop.drafter.proposer.runner


@pytest.mark.slow
async def test_more_requests_than_the_pool_holds_all_finish_exactly(pair, reference):
    # 6 requests of 100 + 60 positions: 60 blocks at their full length; the target's pool has 40
    coord = coordinator(pair, target_blocks=40, draft_blocks=80)
    batch = prompts(6, 100)
    want = [hf_greedy(reference, p, 60) for p in batch]
    async with running_server(coord) as h:
        modes = [pb.SPECULATION_MODE_PEARL, pb.SPECULATION_MODE_OFF] * 3
        got = await asyncio.gather(*(collect(h.stub, greedy_request(p, 60, m), timeout=300)
                                     for p, m in zip(batch, modes)))
        assert [tokens(g) for g in got] == want
        scheduler, target, _ = await pools(coord)
        assert scheduler.kv.num_preemptions > 0
        await wait_until_nothing_held(h.server, coord, MODEL)
        assert target.cache_stats().free_blocks == 40


async def test_cached_prompt_tokens_are_reported(pair, reference):
    coord = coordinator(pair, target_blocks=64, draft_blocks=64)
    system = prompts(1, 70, seed=3)[0]
    async with running_server(coord) as h:
        first = await collect(h.stub, greedy_request(system + [5, 6, 7], 8))
        second = await collect(h.stub, greedy_request(system + [8, 9], 8))
        assert first[-1].usage.cached_prompt_tokens == 0
        assert second[-1].usage.cached_prompt_tokens == 64  # the system prompt's 4 full blocks
        assert tokens(second) == hf_greedy(reference, system + [8, 9], 8)
        _, target, draft = await pools(coord)
        assert draft.cache_stats().hits == 64  # the drafter skipped the same prefill


async def test_a_cached_prompt_longer_than_a_prefill_chunk_is_read_in_one_round(pair, reference):
    """Prefill chunks of 32 tokens: the second request's first chunk carries the rest of the prompt
    too, and the target feeds all of it its cache holds (9 blocks) plus 32 computed positions."""
    coord = coordinator(pair, target_blocks=64, draft_blocks=64, prefill_chunk_tokens=32)
    system = prompts(1, 150, seed=4)[0]
    async with running_server(coord) as h:
        await collect(h.stub, greedy_request(system + [5, 6], 6, pb.SPECULATION_MODE_OFF))
        scheduler, _, _ = await pools(coord)
        rounds = scheduler.target_times.messages
        second = await collect(h.stub, greedy_request(system + [7, 8], 6, pb.SPECULATION_MODE_OFF))
        assert second[-1].usage.cached_prompt_tokens == 144
        assert tokens(second) == hf_greedy(reference, system + [7, 8], 6)
        # one prefill round (the cache and the rest of the prompt), one per token, and maybe a batch
        # that released a request: the first one's, or this one's, when it went out before the count is
        # read (chunk by chunk, the prefill alone would take five: 11 at least)
        assert scheduler.target_times.messages - rounds <= 1 + 6 + 2


@pytest.mark.slow
async def test_the_pools_hold_nothing_after_a_soak(pair):
    """Finished, cancelled mid-stream, refused (past the context) and preempted requests, at once."""
    coord = coordinator(pair, target_blocks=40, draft_blocks=40)
    async with running_server(coord) as h:
        scheduler, target, draft = await pools(coord)
        start = (target.cache_stats().free_blocks, draft.cache_stats().free_blocks)

        async def cancelled(prompt):
            call = h.stub.Generate(greedy_request(prompt, 80))
            async for _ in call:
                call.cancel()
                break

        async def refused(prompt):
            with pytest.raises(grpc.aio.AioRpcError):
                await collect(h.stub, greedy_request(prompt, CONTEXT))

        for round_ in range(3):
            batch = prompts(8, 90, seed=10 + round_)
            jobs = [collect(h.stub, greedy_request(p, 50), timeout=300) for p in batch[:5]]
            jobs += [cancelled(p) for p in batch[5:7]] + [refused(batch[7])]
            await asyncio.gather(*jobs)
        assert scheduler.kv.num_preemptions > 0
        await wait_until_nothing_held(h.server, coord, MODEL)
        assert (target.cache_stats().free_blocks, draft.cache_stats().free_blocks) == start == (40, 40)
