"""Shared pieces for the server tests (this module holds no tests of its own).

`server_coordinator()` is the real in-process coordinator (`coordinator.local.LocalCoordinator`: the
scheduler, policies and workers of the Ray pipeline, on threads) over the tiny pair, recording the
requests the server hands it; `step_delay_s` puts a sleep before every target forward, so a stream
of N tokens in mode off lasts at least N × step_delay_s on any machine.

`TargetOnlyCoordinator` is a test double of the Coordinator protocol that runs the tiny target token
by token with transformers (mode off), for tests that need no scheduler: the HTTP front's slow
streams, a server in a subprocess, a client-only install.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import socket
import time
from dataclasses import dataclass

import grpc
import pytest

from duospec.coordinator.api import (
    FinishEvent, FinishReason, GenerationRequest, ModelInfo, SpecStats, TokensEvent, Unavailable,
)
from duospec.coordinator.config import ModelConfig, ServerSettings
from duospec.coordinator.local import LocalCoordinator, load_runner
from duospec.coordinator.models import model_info
from duospec.coordinator.scheduling.router import scheduler_config
from duospec.coordinator.serving.server import DuospecServer
from duospec.v1 import generation_pb2 as pb
from duospec.v1 import generation_pb2_grpc as pb_grpc
from exactness import reference_model

MODEL = "tiny"
MAX_CONTEXT = 256


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for servers that must be told a port: several processes share it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        from transformers import AutoTokenizer

        torch.set_num_threads(1)
        self._torch = torch
        self.model = reference_model(str(target))
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


class RecordingCoordinator(LocalCoordinator):
    """LocalCoordinator that keeps every request the server hands it (`started`, in order) and when
    each began and ended (`spans[i]`: monotonic start, end or None while it runs): what the server
    passed on, tenant and internal id included, is then something a test can assert on."""

    def __init__(self, models: list[ModelConfig], *, runners: dict | None = None):
        super().__init__(models, runners=runners)
        self.started: list[GenerationRequest] = []
        self.spans: list[list[float | None]] = []

    async def generate(self, request: GenerationRequest):
        self.started.append(request)
        span = [time.monotonic(), None]
        self.spans.append(span)
        try:
            async for event in super().generate(request):
                yield event
        finally:
            span[1] = time.monotonic()


def delayed_target(config: ModelConfig, step_delay_s: float):
    """The target's runner, loaded as LocalCoordinator loads it, sleeping `step_delay_s` before each
    forward (every verify and prefill goes through forward_for_verify)."""
    info = model_info(config)
    runner = load_runner(info.target_path, config, scheduler_config(config).max_num_seqs, info.max_context)
    forward = runner.forward_for_verify

    def forward_after_a_pause(*args, **kwargs):
        time.sleep(step_delay_s)  # on the target's own thread, as a busy device would hold it
        return forward(*args, **kwargs)

    runner.forward_for_verify = forward_after_a_pause
    return runner


def server_coordinator(tiny_pair, step_delay_s: float = 0.0) -> RecordingCoordinator:
    target, draft = tiny_pair
    config = ModelConfig(name=MODEL, target=str(target), draft=str(draft), device="cpu")
    runners = None
    if step_delay_s:
        info = model_info(config)
        draft_runner = load_runner(str(draft), config, scheduler_config(config).max_num_seqs, info.max_context)
        runners = {MODEL: (delayed_target(config, step_delay_s), draft_runner)}
    return RecordingCoordinator([config], runners=runners)


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
