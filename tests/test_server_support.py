"""Shared pieces for the server tests (this module holds no tests of its own).

`server_coordinator()` returns the real in-process coordinator (`coordinator.local.LocalCoordinator`)
when it exists, else `TargetOnlyCoordinator`: a unit-test double that implements the Coordinator
protocol by running the tiny target checkpoint token by token with transformers (mode OFF
semantics). Tests written against either must pass against both; re-run them once LocalCoordinator
lands (see the report in the server PR).
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import time
from dataclasses import dataclass

import grpc
import pytest

from duospec.coordinator.api import (
    FinishEvent, FinishReason, GenerationRequest, ModelInfo, SpecStats, TokensEvent, Unavailable,
)
from duospec.coordinator.config import ModelConfig, ServerSettings
from duospec.coordinator.server import DuospecServer
from duospec.v1 import generation_pb2 as pb
from duospec.v1 import generation_pb2_grpc as pb_grpc

MODEL = "tiny"
MAX_CONTEXT = 256


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    from tiny_models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("server-models")
    target = make_tiny_checkpoint(root / "target", "llama", seed=1, max_position_embeddings=MAX_CONTEXT)
    draft = make_tiny_checkpoint(root / "draft", "llama", seed=2, hidden_size=32, num_layers=1,
                                 max_position_embeddings=MAX_CONTEXT)
    return target, draft


class TargetOnlyCoordinator:
    """Test double: greedy/sampled decoding of the target with transformers, one token per step.

    `step_delay_s` slows each step so cancel/deadline tests can catch a stream mid-flight.
    """

    def __init__(self, target: pathlib.Path, draft: pathlib.Path | None = None, name: str = MODEL,
                 step_delay_s: float = 0.0):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self._torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(target)).eval()
        tok = AutoTokenizer.from_pretrained(str(target))
        self.info = ModelInfo(name=name, target_path=str(target), draft_path=str(draft) if draft else None,
                              vocab_size=len(tok), max_context=MAX_CONTEXT, eos_token_id=tok.eos_token_id)
        self.step_delay_s = step_delay_s
        self.live = 0
        self.started: list[GenerationRequest] = []
        self.closed = False

    def models(self) -> list[ModelInfo]:
        return [self.info]

    async def stats(self) -> dict:
        return {"ready": not self.closed, "live_sequences": self.live,
                "actors": {"target": {"slots_in_use": self.live, "free_slots": 64 - self.live}}}

    async def close(self) -> None:
        self.closed = True

    async def generate(self, request: GenerationRequest):
        if self.closed:
            raise Unavailable("coordinator closed")
        self.started.append(request)
        self.live += 1
        try:
            ids = list(request.prompt_token_ids)
            past, produced = None, 0
            gen = self._torch.Generator().manual_seed(request.sampling.seed)
            while True:
                feed = ids if past is None else ids[-1:]
                token, past = await asyncio.to_thread(self._step, feed, past, request, gen)
                if self.step_delay_s:
                    await asyncio.sleep(self.step_delay_s)
                ids.append(token)
                produced += 1
                yield TokensEvent((token,))
                reason = self._finish_reason(request, token, produced)
                if reason is not None:
                    yield FinishEvent(reason, len(request.prompt_token_ids), produced, SpecStats())
                    return
        finally:
            self.live -= 1

    def _step(self, feed, past, request, gen):
        torch = self._torch
        with torch.no_grad():
            out = self.model(torch.tensor([feed]), past_key_values=past, use_cache=True)
        logits = out.logits[0, -1]
        if request.sampling.greedy:
            return int(torch.argmax(logits)), out.past_key_values
        probs = torch.softmax(logits / request.sampling.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=gen)), out.past_key_values

    def _finish_reason(self, request, token, produced) -> FinishReason | None:
        if token in request.stop_token_ids:
            return FinishReason.STOP
        if not request.ignore_eos and token == self.info.eos_token_id:
            return FinishReason.EOS
        if produced >= request.max_new_tokens:
            return FinishReason.LENGTH
        return None


def server_coordinator(tiny_pair, step_delay_s: float = 0.0):
    target, draft = tiny_pair
    try:
        from duospec.coordinator.local import LocalCoordinator
    except ImportError:
        return TargetOnlyCoordinator(target, draft, step_delay_s=step_delay_s)
    return LocalCoordinator([ModelConfig(name=MODEL, target=str(target), draft=str(draft), device="cpu")])


@dataclass
class Harness:
    server: DuospecServer
    channel: grpc.aio.Channel
    stub: pb_grpc.GenerationServiceStub
    coordinator: object


@contextlib.asynccontextmanager
async def running_server(coordinator, settings: ServerSettings | None = None, **server_kwargs):
    settings = settings or ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=0)
    server = DuospecServer(coordinator, settings, health_poll_s=0.05, **server_kwargs)
    port = await server.start()
    await server.wait_ready(timeout=30)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Harness(server, channel, pb_grpc.GenerationServiceStub(channel), coordinator)
    finally:
        await channel.close()
        await server.shutdown(grace_period_s=1.0)


def request(prompt: str = "def fib(n):", max_new_tokens: int = 16, **kwargs) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens), **kwargs)


async def collect(stub, req: pb.GenerateRequest, api_key: str | None = None, timeout: float | None = 60):
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
    return [m async for m in stub.Generate(req, metadata=metadata, timeout=timeout)]


async def rpc_error(stub, req: pb.GenerateRequest, api_key: str | None = None) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, req, api_key)
    return info.value


async def wait_until_nothing_held(server: DuospecServer, coordinator, model: str, within_s: float = 10.0) -> None:
    """The workers, admission and the stream lifecycle let go of finished streams asynchronously:
    poll until none holds anything (a leak never clears) and fail with what still is after
    `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        workers = (await coordinator.worker_stats()).get(model, {})
        held = {"workers": {role: w["live_sequences"] for role, w in workers.items()},
                "admission": (server.admission.running, server.admission.waiting),
                "active_streams": server.lifecycle.active_streams}
        if not any(held["workers"].values()) and held["admission"] == (0, 0) and not held["active_streams"]:
            return
        assert time.monotonic() < deadline, f"still held {within_s:.0f} s after the streams ended: {held}"
        await asyncio.sleep(0.02)
