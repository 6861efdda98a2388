"""In-process decoding on the engine, for tests, benchmarks and notebooks.

    target = load_checkpoint("models/target"); draft = load_checkpoint("models/draft")
    result = vanilla_speculative(target, draft, prompt_ids, max_new_tokens=64, gamma=4)
    for piece in stream_text(target, draft, prompt_ids, mode="pearl"): print(piece, end="")

These run the same scheduler, policies, drafter and verifier as the served pipeline (one loop, no
copy per mode), with both models in this process on two threads instead of two Ray actors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Iterator

from duospec.coordinator.api import FinishEvent, FinishReason, GenerationRequest, SpecStats, SpeculationMode
from duospec.coordinator.scheduling.links import LocalDraftLink, LocalTargetLink
from duospec.coordinator.scheduling.router import ModelEntry, ModelRouter, scheduler_config
from duospec.coordinator.scheduling.scheduler import Scheduler
from duospec.draft_worker.drafter import Drafter
from duospec.draft_worker.model_proposer import ModelProposer
from duospec.draft_worker.proposer import DraftMethod, DraftSpec, Proposer
from duospec.sampling import SamplingParams
from duospec.target_worker.verifier import Verifier

_request_ids = itertools.count(1)


@dataclass
class DecodeResult:
    token_ids: list[int]  # generated tokens only
    text: str
    finish_reason: FinishReason
    stats: SpecStats


def as_proposer(draft) -> Proposer | None:
    """`draft` as a Proposer: a LoadedCheckpoint drafts as a model; a Proposer is used as it is."""
    if draft is None or isinstance(draft, Proposer):
        return draft
    return ModelProposer(draft.runner)


def _router(target, draft, *, gamma: int, max_lookahead: int, max_batch_size: int, adaptive=False) -> ModelRouter:
    """A one-model router over an already-loaded target (duospec.engine.LoadedCheckpoint) and a draft
    (a LoadedCheckpoint: the model drafter; or any Proposer, e.g. NgramProposer)."""
    from duospec.coordinator.config import ModelConfig, SpeculationDefaults
    from duospec.coordinator.models import model_info

    runner = target.runner
    proposer = as_proposer(draft)
    limits = [runner.max_context] + ([proposer.max_context] if proposer is not None and proposer.max_context else [])
    # A draft checkpoint is described as the serve config would; a Proposer object has no config form
    # (its checkpoint, if any, is not recoverable), so the model is read target-only and the method noted.
    spec = None if proposer is None or proposer is draft else DraftSpec(method=DraftMethod.MODEL, path=str(draft.path))
    # The model's defaults otherwise (the speculation cache and token trees on), as `duospec serve` has them.
    config = ModelConfig(name="in-process", target=str(target.path), draft=spec, max_batch_size=max_batch_size,
                         max_num_seqs=min(runner.max_slots, 64), speculation=SpeculationDefaults(
                             mode=SpeculationMode.PEARL, max_draft_tokens=gamma, gamma=gamma,
                             max_lookahead=max_lookahead, adaptive=adaptive))
    info = dataclasses.replace(model_info(config, max_context=min(limits)),
                               draft_method=proposer.method.value if proposer is not None else None)
    sched_config = scheduler_config(config)

    async def open_scheduler() -> Scheduler:
        draft_link = LocalDraftLink(Drafter(proposer)) if proposer is not None else None
        scheduler = Scheduler(info, LocalTargetLink(Verifier(runner)), draft_link, sched_config)
        await scheduler.start()
        return scheduler

    router = ModelRouter()
    router.add_model(ModelEntry(info, config, open_scheduler))
    return router


def _request(prompt_ids, max_new_tokens, mode, sampling, gamma, ignore_eos) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"in-process-{next(_request_ids)}",
        prompt_token_ids=tuple(int(t) for t in prompt_ids),
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        mode=SpeculationMode(mode),
        max_draft_tokens=gamma,
        ignore_eos=ignore_eos,
    )


def stream_events(target, draft, requests: list[GenerationRequest], *, gamma=4, max_lookahead=9, max_batch_size=8):
    """Runs several requests concurrently; returns {request_id: [events]} (both models in-process)."""

    async def run():
        router = _router(target, draft, gamma=gamma, max_lookahead=max_lookahead, max_batch_size=max_batch_size)
        try:
            async def collect(req):
                return req.request_id, [event async for event in router.generate(req)]

            return dict(await asyncio.gather(*(collect(r) for r in requests)))
        finally:
            await router.close()

    return asyncio.run(run())


def stream_text(
    target,
    draft,
    prompt_ids,
    *,
    max_new_tokens: int = 64,
    mode: str = "pearl",
    sampling: SamplingParams = SamplingParams(),
    gamma: int = 4,
    ignore_eos: bool = False,
) -> Iterator[str]:
    """Yields text pieces as tokens are committed (never a broken UTF-8 character); the pieces
    concatenate to tokenizer.decode(generated ids)."""
    from duospec.detokenizer import IncrementalDetokenizer

    request = _request(prompt_ids, max_new_tokens, mode, sampling, gamma, ignore_eos)
    detok = IncrementalDetokenizer(target.tokenizer, request.prompt_token_ids)
    loop = asyncio.new_event_loop()
    router = None
    try:
        router = _router(target, draft, gamma=gamma, max_lookahead=max(8, gamma), max_batch_size=1)
        events = router.generate(request)
        while True:
            try:
                event = loop.run_until_complete(events.__anext__())
            except StopAsyncIteration:
                break
            if isinstance(event, FinishEvent):
                break
            piece = detok.push(event.token_ids)
            if piece:
                yield piece
        tail = detok.flush()
        if tail:
            yield tail
    finally:
        if router is not None:
            loop.run_until_complete(router.close())
        loop.close()


def decode(target, draft, prompt_ids, *, max_new_tokens=64, mode="pearl", sampling=SamplingParams(), gamma=4,
           ignore_eos=False) -> DecodeResult:
    request = _request(prompt_ids, max_new_tokens, mode, sampling, gamma, ignore_eos)
    events = stream_events(target, draft, [request], gamma=gamma, max_lookahead=max(8, gamma))[request.request_id]
    finish = events[-1]
    tokens = [t for event in events[:-1] for t in event.token_ids]
    text = target.tokenizer.decode(tokens)
    return DecodeResult(tokens, text, finish.finish_reason, finish.stats)


def autoregressive(target, prompt_ids, *, max_new_tokens=64, sampling=SamplingParams(), ignore_eos=False):
    """Target-only decoding, one token per forward (the `off` mode)."""
    return decode(target, None, prompt_ids, max_new_tokens=max_new_tokens, mode="off", sampling=sampling,
                  ignore_eos=ignore_eos)


def vanilla_speculative(target, draft, prompt_ids, *, gamma=4, max_new_tokens=64, sampling=SamplingParams(),
                        ignore_eos=False):
    """Classic speculative decoding: draft γ tokens, verify them in one target forward, repeat."""
    return decode(target, draft, prompt_ids, max_new_tokens=max_new_tokens, mode="vanilla", sampling=sampling,
                  gamma=gamma, ignore_eos=ignore_eos)
