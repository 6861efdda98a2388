"""Chunked prefill: a long prompt goes to the target (per verify batch) and the drafter (per step) in
chunks of models[].prefill_chunk_tokens, sharing rounds with the other sequences' decode."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch

from duospec.coordinator.api import FinishEvent, GenerationRequest, SpeculationMode, TokensEvent
from duospec.engine import SlotChunk, load_model
from exactness import assert_greedy_equal, hf_greedy, reference_model
from pipeline_support import model_config
from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("chunked")
    target = make_tiny_checkpoint(root / "target", "llama", seed=51, max_position_embeddings=4096)
    draft = make_tiny_checkpoint(root / "draft", "llama", seed=52, hidden_size=32, num_layers=1,
                                 max_position_embeddings=4096)
    return target, draft


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(4, 380, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_in_chunks_gives_the_logits_of_one_shot(pair):
    runner = load_model(pair[0], dtype=torch.float32, max_slots=2, max_context=1024)
    prompt = _prompt(300)
    one, many = runner.allocate_slot(), runner.allocate_slot()
    whole = runner.forward_last([SlotChunk(one, 0, prompt)])
    for start in range(0, 300, 64):
        last = runner.forward_last([SlotChunk(many, start, prompt[start:start + 64])])
    assert torch.allclose(whole, last, atol=1e-4, rtol=0)


async def _run(coordinator, prompt, n, mode, model="m", request_id="r"):
    tokens, stats, gaps, last = [], None, [], None
    async for event in coordinator.generate(GenerationRequest(request_id, tuple(prompt), n, mode=mode, model=model,
                                                              ignore_eos=True)):
        if isinstance(event, TokensEvent):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            tokens.extend(event.token_ids)
        elif isinstance(event, FinishEvent):
            stats = event.stats
    return tokens, stats, gaps


@pytest.mark.parametrize("mode", [SpeculationMode.OFF, SpeculationMode.VANILLA, SpeculationMode.PEARL])
async def test_a_long_prompt_in_chunks_gives_transformers_greedy(pair, mode):

    from duospec.coordinator.local import LocalCoordinator

    config = dataclasses.replace(model_config("m", *pair), prefill_chunk_tokens=32)
    coordinator = LocalCoordinator([config])
    try:
        prompt = _prompt(200, seed=3)
        tokens, stats, _ = await _run(coordinator, prompt, 16, mode)
        hf = reference_model(str(pair[0]))
        assert_greedy_equal(hf, prompt, tokens, hf_greedy(hf, prompt, 16))
        assert stats.target_forwards >= 200 // 32  # the prompt took several forwards
    finally:
        await coordinator.close()


async def test_a_long_prompt_does_not_stall_a_decoding_stream(pair):
    """Stream A decodes while a 2,000-token prompt B arrives. With 128-token chunks B's prefill takes
    ~16 verify rounds and A rides along in each, decoding a token per round; a one-shot prefill is a
    single round. Counted as A's tokens between B's arrival and B's first token: scheduling order,
    not speed, so a GC pause or a preempted CPU cannot flip it."""
    from duospec.coordinator.local import LocalCoordinator

    prompt_len, chunk_size = 2000, 128

    async def tokens_of_a_during_bs_prefill(chunk: int) -> int:
        config = dataclasses.replace(model_config("m", *pair), prefill_chunk_tokens=chunk)
        coordinator = LocalCoordinator([config])
        a_tokens, a_started = 0, asyncio.Event()

        async def stream_a():
            nonlocal a_tokens
            # far more tokens than B's prefill rounds: A is still decoding when B's first token comes
            request = GenerationRequest("a", tuple(_prompt(8, seed=1)), 1000, mode=SpeculationMode.OFF, model="m",
                                        ignore_eos=True)
            async for event in coordinator.generate(request):
                if isinstance(event, TokensEvent):
                    a_tokens += len(event.token_ids)
                    a_started.set()

        a = None
        try:
            await _run(coordinator, _prompt(8), 4, SpeculationMode.OFF)  # warm up
            a = asyncio.ensure_future(stream_a())
            await asyncio.wait_for(a_started.wait(), 120)
            at_arrival, during = a_tokens, None
            request = GenerationRequest("b", tuple(_prompt(prompt_len, seed=2)), 2, mode=SpeculationMode.OFF,
                                        model="m", ignore_eos=True)
            async for event in coordinator.generate(request):
                if isinstance(event, TokensEvent) and during is None:
                    during = a_tokens - at_arrival
            assert during is not None
            assert not a.done(), "stream A ended before B's prefill did: the count would be meaningless"
            return during
        finally:
            if a is not None:
                a.cancel()
                await asyncio.gather(a, return_exceptions=True)
            await coordinator.close()

    one_shot = await tokens_of_a_during_bs_prefill(1 << 20)
    chunked = await tokens_of_a_during_bs_prefill(chunk_size)
    assert one_shot <= 3, one_shot  # one round prefills all of B (plus the round in flight when B came)
    assert chunked >= prompt_len // chunk_size - 1, chunked  # A decoded in (nearly) every chunk's round


def test_the_drafter_reads_a_long_prompt_a_chunk_per_step_and_keeps_drafting_the_others(pair):
    from duospec.draft_worker.drafter import Drafter
    from duospec.draft_worker.methods import build_proposer
    from duospec.draft_worker.proposer import DraftMethod, DraftSpec
    from duospec.internal.v1 import pearl_pb2 as pb

    # stop_confidence 0: the random-weight draft is unsure of every token, and this counts a token per step
    spec = DraftSpec(DraftMethod.MODEL, path=str(pair[1]), stop_confidence=0.0)
    drafter = Drafter(build_proposer(spec, str(pair[0]), max_slots=4, dtype="float32", prefill_chunk_tokens=64))
    for seq_id, prompt in ((1, _prompt(8)), (2, _prompt(300, seed=5))):
        drafter.apply(pb.DraftCommand(seq_id=seq_id, kind=pb.DRAFT_COMMAND_KIND_START, start_pos=0, tail=prompt,
                                      draft_until=len(prompt) + 40, committed_len=len(prompt)))
    steps_until_long = None
    for step in range(1, 12):
        chunks = {c.seq_id: c for c in drafter.step()}
        assert 1 in chunks and len(chunks[1].tokens) == 1  # the short one drafts a token every step
        if 2 in chunks and steps_until_long is None:
            steps_until_long = step
    assert steps_until_long == 5  # 300 tokens read 64 at a time: four chunks, then its first token
