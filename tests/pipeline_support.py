"""Driving a coordinator that lives on its own event-loop thread from synchronous tests.

The coordinator's gRPC streams and scheduler belong to the loop that opened them, so a module-scoped
pipeline needs one loop for the whole module rather than pytest-asyncio's loop per test.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import types

from duospec.coordinator.api import FinishEvent, GenerationRequest, SpeculationMode
from duospec.sampling import SamplingParams

_ids = itertools.count(1)


class BackgroundLoop:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-coordinator-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def model_config(
    name, target, draft, *, device="cpu", max_draft_tokens=4, max_lookahead=8, max_batch_size=8, adaptive=False
):
    """Adaptive draft length is off by default here: exactness tests must exercise the abort path
    even when the draft is so bad that the scheduler would stop speculating."""
    from duospec.coordinator.config import ModelConfig, SpeculationDefaults

    return ModelConfig(
        name=name,
        target=str(target),
        draft=str(draft) if draft else None,
        device=device,
        dtype="float32",
        max_batch_size=max_batch_size,
        speculation=SpeculationDefaults(
            mode=SpeculationMode.PEARL, max_draft_tokens=max_draft_tokens, gamma=max_draft_tokens, max_lookahead=max_lookahead,
            adaptive=adaptive,
        ),
    )


def request(prompt, max_new_tokens=64, mode="pearl", sampling=SamplingParams(), **kw) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"test-{next(_ids)}",
        prompt_token_ids=tuple(prompt),
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        mode=SpeculationMode(mode),
        ignore_eos=kw.pop("ignore_eos", True),
        **kw,
    )


async def run_one(coordinator, req) -> types.SimpleNamespace:
    tokens, finish = [], None
    async for event in coordinator.generate(req):
        if isinstance(event, FinishEvent):
            finish = event
        else:
            tokens.extend(event.token_ids)
    return types.SimpleNamespace(tokens=tokens, finish=finish, stats=finish.stats if finish else None)


async def run_all(coordinator, requests):
    return await asyncio.gather(*(run_one(coordinator, r) for r in requests))
