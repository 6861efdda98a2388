"""duospec.Client / AsyncClient against a real in-process grpc.aio server with scripted replies.

`ScriptedServer` (also used by tests/e2e/test_cli_client.py) runs a `GenerationServiceServicer` on its
own event loop in a background thread, so blocking and asyncio clients can both call it. Each
Generate call consumes the next script from `servicer.scripts`; an empty queue means a normal
three-chunk completion (`COMPLETION`).
"""

from __future__ import annotations

import json

import asyncio
import datetime
import os
import subprocess
import sys
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

import duospec
from duospec import sdk
from duospec.v1 import generation_pb2 as pb
from duospec.v1 import generation_pb2_grpc as pb_grpc
from tiny_models import make_tiny_checkpoint

STATS = pb.SpeculationStats(
    drafted_tokens=8, accepted_tokens=6, target_forwards=3, mean_accepted_length=3.0,
    pre_verify_aborts=1, wasted_draft_tokens=2,
)


def completion(request_id: str = "req-1") -> list[pb.GenerateResponse]:
    """A normal stream: two deltas, then the final message with finish reason, usage and stats."""
    return [
        pb.GenerateResponse(request_id=request_id, text="def ", token_ids=[11, 12]),
        pb.GenerateResponse(request_id=request_id, text="fib(n):", token_ids=[13]),
        pb.GenerateResponse(
            request_id=request_id, text="\n", token_ids=[14], finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=5, completion_tokens=4), stats=STATS,
        ),
    ]


COMPLETION_TEXT = "def fib(n):\n"


@dataclass
class Abort:
    code: grpc.StatusCode
    message: str = "scripted failure"
    trailing: tuple[tuple[str, str], ...] = ()


@dataclass
class Sleep:
    seconds: float


@dataclass
class ScriptedServicer(pb_grpc.GenerationServiceServicer):
    scripts: deque = field(default_factory=deque)  # each: list of GenerateResponse | Abort | Sleep
    requests: list = field(default_factory=list)
    metadata: list = field(default_factory=list)  # invocation metadata (dict) per call
    cancelled: threading.Event = field(default_factory=threading.Event)
    models_script: list = field(default_factory=list)  # Abort(s) to answer ListModels with first

    async def Generate(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        steps = self.scripts.popleft() if self.scripts else completion(request.request_id or "req-1")
        try:
            for step in steps:
                if isinstance(step, Abort):
                    await context.abort(step.code, step.message, trailing_metadata=step.trailing)
                elif isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                else:
                    yield step
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def ListModels(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        if self.models_script:
            step = self.models_script.pop(0)
            await context.abort(step.code, step.message)
        return pb.ListModelsResponse(models=[
            pb.ModelCard(name="python-tiny", target="/m/target", draft="/m/draft", vocab_size=4096,
                         max_context=1024, default_mode=pb.SPECULATION_MODE_PEARL,
                         target_node_id="node-b", draft_node_id="node-a", replicas=[
                             pb.ReplicaStatus(index=0, state=pb.REPLICA_STATE_SERVING, live_sequences=3,
                                              outstanding_tokens=120, target_node_id="node-b", draft_node_id="node-a"),
                             pb.ReplicaStatus(index=1, state=pb.REPLICA_STATE_DOWN, target_restarts=2,
                                              target_node_id="node-c", draft_node_id="node-c")]),
            pb.ModelCard(name="target-only", target="/m/t2", vocab_size=4096, max_context=512,
                         default_mode=pb.SPECULATION_MODE_OFF),
        ])


class ScriptedServer:
    """A grpc.aio server on 127.0.0.1:<free port>, on its own loop thread. Use as a context manager."""

    def __init__(self, servicer: ScriptedServicer, server_credentials=None, host: str = "127.0.0.1"):
        self.servicer = servicer
        self._credentials = server_credentials
        self._host = host
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"{self._host}:{self.port}"

    async def _start(self) -> int:
        self._server = grpc.aio.server()
        pb_grpc.add_GenerationServiceServicer_to_server(self.servicer, self._server)
        health = health_aio.HealthServicer()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health, self._server)
        bind = f"{self._host}:0"
        if self._credentials is None:
            port = self._server.add_insecure_port(bind)
        else:
            port = self._server.add_secure_port(bind, self._credentials)
        await self._server.start()
        return port

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.fixture
def server():
    with ScriptedServer(ScriptedServicer()) as srv:
        yield srv


@pytest.fixture
def client(server):
    with duospec.Client(server.address, api_key="sk-test-123", timeout=10) as c:
        yield c


# ---- streaming and result assembly --------------------------------------------------------------

def test_stream_yields_deltas_and_final_chunk(client):
    with client.generate("def fib", stream=True) as stream:
        chunks = list(stream)
    assert [c.text for c in chunks] == ["def ", "fib(n):", "\n"]
    assert [c.token_ids for c in chunks] == [(11, 12), (13,), (14,)]
    assert [c.finish_reason for c in chunks] == [None, None, "length"]
    assert chunks[0].usage is None and chunks[0].stats is None
    assert chunks[-1].usage == sdk.Usage(prompt_tokens=5, completion_tokens=4)
    assert chunks[-1].stats.mean_accepted_length == 3.0
    assert chunks[-1].stats.acceptance_rate == 0.75


def test_generate_assembles_full_result(client):
    result = client.generate("def fib", request_id="mine-7")
    assert isinstance(result, duospec.GenerationResult)
    assert result.text == COMPLETION_TEXT
    assert result.token_ids == (11, 12, 13, 14)
    assert result.finish_reason == "length"
    assert result.request_id == "mine-7"
    assert result.usage.completion_tokens == 4
    assert result.stats == sdk.SpeculationStats(8, 6, 3, 3.0, 1, 2)


def test_request_fields_reach_the_server(client, server):
    client.generate(
        "def f():", model="python-tiny", max_new_tokens=17, temperature=0.7, top_k=40, top_p=0.9,
        seed=2**63, stop="\n\n", stop_token_ids=[2], ignore_eos=True, mode="vanilla", max_draft_tokens=5,
    )
    client.generate(prompt_token_ids=[5, 6, 7], mode="off")
    client.generate(messages=[{"role": "user", "content": "hi"}, ("assistant", "hello")])
    first, ids, chat = server.servicer.requests
    assert first.prompt == "def f():" and first.model == "python-tiny"
    assert first.stopping.max_new_tokens == 17 and list(first.stopping.stop) == ["\n\n"]
    assert list(first.stopping.stop_token_ids) == [2] and first.stopping.ignore_eos
    assert first.sampling.top_k == 40 and first.sampling.seed == 2**63
    assert first.sampling.temperature == pytest.approx(0.7) and first.sampling.top_p == pytest.approx(0.9)
    assert first.speculation.mode == pb.SPECULATION_MODE_VANILLA and first.speculation.max_draft_tokens == 5
    assert list(ids.prompt_token_ids.ids) == [5, 6, 7] and ids.speculation.mode == pb.SPECULATION_MODE_OFF
    assert not ids.sampling.HasField("seed")
    assert [(m.role, m.content) for m in chat.messages.messages] == [("user", "hi"), ("assistant", "hello")]
    assert chat.speculation.mode == pb.SPECULATION_MODE_UNSPECIFIED  # None = the model's default


def test_api_key_sent_as_bearer_metadata(client, server):
    client.generate("x")
    client.models()
    assert [md.get("authorization") for md in server.servicer.metadata] == ["Bearer sk-test-123"] * 2


def test_no_api_key_sends_no_authorization(server):
    with duospec.Client(server.address) as anonymous:
        anonymous.generate("x")
    assert "authorization" not in server.servicer.metadata[0]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one of"),
        ({}, "exactly one of"),
        ({"prompt": "a", "mode": "turbo"}, "mode"),
        ({"prompt": "a", "max_new_tokens": -1}, "max_new_tokens"),
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids[1]"),
        ({"prompt": "a", "temperature": float("nan")}, "temperature"),
        ({"messages": [{"role": "user"}]}, "messages[0]"),
    ],
)
def test_bad_arguments_fail_locally_naming_the_field(client, server, kwargs, field):
    with pytest.raises(sdk.InvalidArgument, match=field.replace("[", r"\[")) as info:
        client.generate(**kwargs)
    assert isinstance(info.value, ValueError)
    assert server.servicer.requests == []


def test_truncated_stream_is_an_error(client, server):
    server.servicer.scripts.append(completion()[:2])
    with pytest.raises(duospec.DuospecError, match="before the final message") as info:
        client.generate("x")
    assert info.value.code == "INTERNAL"


# ---- status codes → exceptions ------------------------------------------------------------------

ERROR_CLASSES = [
    (grpc.StatusCode.INVALID_ARGUMENT, sdk.InvalidArgument),
    (grpc.StatusCode.UNAUTHENTICATED, sdk.Unauthenticated),
    (grpc.StatusCode.PERMISSION_DENIED, sdk.PermissionDenied),
    (grpc.StatusCode.NOT_FOUND, sdk.NotFound),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, sdk.ResourceExhausted),
    (grpc.StatusCode.DEADLINE_EXCEEDED, sdk.DeadlineExceeded),
    (grpc.StatusCode.UNAVAILABLE, sdk.Unavailable),
    (grpc.StatusCode.CANCELLED, sdk.Cancelled),
    (grpc.StatusCode.INTERNAL, sdk.DuospecError),
]


@pytest.mark.parametrize("status, cls", ERROR_CLASSES, ids=[s.name for s, _ in ERROR_CLASSES])
def test_status_code_maps_to_exception_class(server, status, cls):
    server.servicer.scripts.append([Abort(status, "model 'x' is not served")])
    with duospec.Client(server.address, max_retries=0) as c, pytest.raises(cls) as info:
        c.generate("x")
    assert type(info.value) is cls
    assert info.value.code == status.name
    assert info.value.message == "model 'x' is not served"
    assert str(info.value) == f"{status.name}: model 'x' is not served"


def test_resource_exhausted_carries_retry_after(client, server):
    server.servicer.scripts.append(
        [Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "tokens/min limit", (("retry-after-s", "1.5"),))]
    )
    with pytest.raises(sdk.ResourceExhausted) as info:
        client.generate("x")
    assert info.value.retry_after_s == 1.5
    assert sdk.ResourceExhausted("RESOURCE_EXHAUSTED", "queue full").retry_after_s is None


def test_models_error_is_typed(client, server):
    server.servicer.models_script.append(Abort(grpc.StatusCode.UNAUTHENTICATED, "bad key"))
    with pytest.raises(sdk.Unauthenticated, match="bad key"):
        client.models()


# ---- retries and deadlines ----------------------------------------------------------------------

def test_unavailable_before_first_token_is_retried(client, server):
    unavailable = [Abort(grpc.StatusCode.UNAVAILABLE, "draining")]
    server.servicer.scripts.extend([unavailable, unavailable])
    assert client.generate("x").text == COMPLETION_TEXT
    assert len(server.servicer.requests) == 3


def test_unavailable_after_first_token_is_not_retried(client, server):
    server.servicer.scripts.append([completion()[0], Abort(grpc.StatusCode.UNAVAILABLE, "actor died")])
    with pytest.raises(sdk.Unavailable, match="actor died"):
        client.generate("x")
    assert len(server.servicer.requests) == 1


def test_stream_failing_mid_way_raises_after_delivered_chunks(client, server):
    server.servicer.scripts.append([completion()[0], Abort(grpc.StatusCode.UNAVAILABLE, "actor died")])
    stream = client.generate("x", stream=True)
    assert next(stream).text == "def "
    with pytest.raises(sdk.Unavailable):
        next(stream)
    assert len(server.servicer.requests) == 1


def test_retries_are_bounded_by_max_retries(server):
    server.servicer.scripts.extend([[Abort(grpc.StatusCode.UNAVAILABLE, "down")]] * 5)
    with duospec.Client(server.address, max_retries=2) as c, pytest.raises(sdk.Unavailable):
        c.generate("x")
    assert len(server.servicer.requests) == 3


def test_other_errors_are_not_retried(client, server):
    server.servicer.scripts.append([Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")])
    with pytest.raises(sdk.ResourceExhausted):
        client.generate("x")
    assert len(server.servicer.requests) == 1


def test_deadline_raises_deadline_exceeded(client, server):
    server.servicer.scripts.append([Sleep(5.0), *completion()])
    start = time.monotonic()
    with pytest.raises(sdk.DeadlineExceeded):
        client.generate("x", timeout=0.3)
    assert time.monotonic() - start < 2.0


def test_unreachable_server_is_unavailable_within_the_deadline():
    # No retries: a retry's backoff sleep overshooting on a loaded machine would leave the last attempt
    # no time, and it would end DEADLINE_EXCEEDED. Retries are covered by the tests above.
    start = time.monotonic()
    with duospec.Client("127.0.0.1:1", timeout=1.0, max_retries=0) as c, pytest.raises(sdk.Unavailable):
        c.generate("x")
    assert time.monotonic() - start < 2.0


def test_closing_a_stream_cancels_the_call_on_the_server(client, server):
    server.servicer.scripts.append([completion()[0], Sleep(5.0), *completion()[1:]])
    with client.generate("x", stream=True) as stream:
        assert next(stream).text == "def "
    assert server.servicer.cancelled.wait(3.0)


# ---- models, health, TLS ------------------------------------------------------------------------

def test_models_and_health(client):
    cards = client.models()
    assert [c.name for c in cards] == ["python-tiny", "target-only"]
    assert cards[0] == duospec.ModelCard("python-tiny", "/m/target", "/m/draft", 4096, 1024, "pearl", "node-b", "node-a",
                                         replicas=(duospec.ReplicaStatus(0, "serving", 3, 120, 0, 0, "node-b", "node-a"),
                                                   duospec.ReplicaStatus(1, "down", 0, 0, 2, 0, "node-c", "node-c")))
    assert cards[1].default_mode == "off" and cards[1].draft == ""
    assert client.health() == "SERVING"


def _self_signed_localhost() -> tuple[bytes, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def test_tls_with_root_certificate_file(tmp_path):
    cert, key = _self_signed_localhost()
    (tmp_path / "ca.pem").write_bytes(cert)
    creds = grpc.ssl_server_credentials([(key, cert)])
    with ScriptedServer(ScriptedServicer(), creds, host="localhost") as srv:
        with duospec.Client(srv.address, tls=tmp_path / "ca.pem", timeout=10) as c:
            assert c.generate("x").text == COMPLETION_TEXT
        with duospec.Client(srv.address, tls=False, timeout=5, max_retries=0) as plain:
            with pytest.raises(sdk.Unavailable):
                plain.generate("x")


def test_missing_tls_file_names_the_argument(tmp_path):
    with pytest.raises(sdk.InvalidArgument, match="tls: cannot read PEM file"):
        duospec.Client("localhost:1", tls=tmp_path / "missing.pem")


# ---- AsyncClient --------------------------------------------------------------------------------

async def test_async_stream_and_result(server):
    async with duospec.AsyncClient(server.address, api_key="sk-a", timeout=10) as c:
        stream = await c.generate("x", stream=True)
        chunks = [chunk async for chunk in stream]
        result = await c.generate("x")
        cards = await c.models()
        assert await c.health() == "SERVING"
    assert "".join(ch.text for ch in chunks) == result.text == COMPLETION_TEXT
    assert chunks[-1].finish_reason == result.finish_reason == "length"
    assert result.token_ids == (11, 12, 13, 14) and result.stats.drafted_tokens == 8
    assert cards[0].default_mode == "pearl"
    assert server.servicer.metadata[0]["authorization"] == "Bearer sk-a"


@pytest.mark.parametrize("status, cls", ERROR_CLASSES, ids=[s.name for s, _ in ERROR_CLASSES])
async def test_async_status_code_maps_to_exception_class(server, status, cls):
    server.servicer.scripts.append([Abort(status, "nope", (("retry-after-s", "2"),))])
    async with duospec.AsyncClient(server.address, max_retries=0) as c:
        with pytest.raises(cls) as info:
            await c.generate("x")
    assert type(info.value) is cls and info.value.code == status.name


async def test_async_retry_only_before_first_token(server):
    unavailable = [Abort(grpc.StatusCode.UNAVAILABLE, "draining")]
    server.servicer.scripts.extend([unavailable, unavailable])
    async with duospec.AsyncClient(server.address, timeout=10) as c:
        assert (await c.generate("x")).text == COMPLETION_TEXT
        assert len(server.servicer.requests) == 3
        server.servicer.scripts.append([completion()[0], Abort(grpc.StatusCode.UNAVAILABLE, "died")])
        with pytest.raises(sdk.Unavailable, match="died"):
            await c.generate("x")
    assert len(server.servicer.requests) == 4


async def test_async_deadline(server):
    server.servicer.scripts.append([Sleep(5.0), *completion()])
    async with duospec.AsyncClient(server.address) as c:
        start = time.monotonic()
        with pytest.raises(sdk.DeadlineExceeded):
            await c.generate("x", timeout=0.3)
    assert time.monotonic() - start < 2.0


async def test_async_cancel_reaches_the_server(server):
    server.servicer.scripts.append([completion()[0], Sleep(5.0), *completion()[1:]])
    async with duospec.AsyncClient(server.address, timeout=10) as c:
        async with await c.generate("x", stream=True) as stream:
            assert (await stream.__anext__()).text == "def "
        assert await asyncio.to_thread(server.servicer.cancelled.wait, 3.0)


# ---- end to end: `duospec serve --backend local` as a subprocess --------------------------------

E2E_PROMPT = "def tokenize(text):\n    return"
E2E_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def served_tiny_model(tmp_path_factory):
    """`python -m duospec serve --backend local` on a tiny random pair; yields (address, model_dir)."""
    root = tmp_path_factory.mktemp("served")
    make_tiny_checkpoint(root / "target", "llama", seed=3)
    make_tiny_checkpoint(root / "draft", "llama", seed=4, hidden_size=32, num_layers=1, tokenizer_dir=root / "target")
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "duospec", "serve", "--backend", "local", "--port", "0", "--metrics-port", "0", "--http-port", "0",
         "--ledger", str(root / "usage.db"), "--model-dir", str(root)],
        cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in proc.stdout:  # blocks until the server says it is ready (or exits)
        lines.append(line)
        if line.startswith("duospec serving on "):
            break
    else:
        proc.wait(timeout=60)
        pytest.fail(f"duospec serve exited ({proc.returncode}) before serving:\n" + "".join(lines[-30:]))
    # Keep reading so a chatty server never blocks on a full pipe.
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    try:
        yield line.split()[-1], root
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0, "duospec serve should exit 0 on SIGTERM"


def _reference_greedy(model_dir, prompt_ids: list[int], n: int) -> tuple[list[int], "torch.Tensor"]:
    """The target alone: transformers greedy generate, plus its logits for near-tie diagnosis."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir / "target"), dtype=torch.float32)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt_ids):].tolist(), torch.cat(out.logits)


def torch_log_softmax(logits):
    import torch

    return torch.log_softmax(logits.float(), dim=-1)


def _assert_same_tokens(got: list[int], want: list[int], logits, label: str) -> None:
    """Token-identical, except at a genuine near-tie of the reference (docs/design.md#exactness), which is reported."""
    if got == want:
        return
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    top2 = logits[i].topk(2).values
    margin = float((top2[0] - top2[1]).abs() / top2[0].abs().clamp_min(1e-12))
    assert margin < 1e-4, f"{label}: differs from the target alone at token {i} (top-2 margin {margin:.2e})"
    warnings.warn(f"{label}: near-tie at token {i}, reference top-2 relative margin {margin:.2e}")


def test_end_to_end_greedy_matches_target_alone(served_tiny_model):
    from transformers import AutoTokenizer

    address, model_dir = served_tiny_model
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir / "target"))
    prompt_ids = tokenizer.encode(E2E_PROMPT, add_special_tokens=True)
    want, logits = _reference_greedy(model_dir, prompt_ids, E2E_NEW_TOKENS)
    with duospec.Client(address, timeout=60) as c:
        assert c.health() == "SERVING"
        assert [card.name for card in c.models()]
        for mode in ("pearl", "vanilla", "off"):
            result = c.generate(E2E_PROMPT, max_new_tokens=E2E_NEW_TOKENS, mode=mode)
            assert result.usage.prompt_tokens == len(prompt_ids)
            assert result.finish_reason in ("length", "eos")
            _assert_same_tokens(list(result.token_ids), want, logits, mode)
            assert result.text == tokenizer.decode(list(result.token_ids))
        chunks = list(c.generate(E2E_PROMPT, max_new_tokens=E2E_NEW_TOKENS, stream=True))
        assert "".join(ch.text for ch in chunks) == result.text
        assert chunks[-1].stats is not None and chunks[-1].finish_reason == result.finish_reason
        with_logprobs = c.generate(E2E_PROMPT, max_new_tokens=E2E_NEW_TOKENS, logprobs=2)
        reference = torch_log_softmax(logits)
        assert [lp.token_id for lp in with_logprobs.logprobs] == list(with_logprobs.token_ids)
        for i, lp in enumerate(with_logprobs.logprobs[: len(want)]):
            if with_logprobs.token_ids[i] != want[i]:
                break  # a near-tie, reported above
            assert abs(lp.logprob - float(reference[i, lp.token_id])) <= 1e-4
            assert [t for t, _ in lp.top] == reference[i].topk(2).indices.tolist()
        with pytest.raises(sdk.NotFound):
            c.generate("x", model="no-such-model")
        with pytest.raises(sdk.InvalidArgument, match="max_new_tokens"):
            c.generate("x", max_new_tokens=10**6)


def test_every_speculation_stat_reaches_the_grpc_response_the_sdk_and_the_openai_usage():
    """Every count the public SpeculationStats message has is filled from SpecStats and read back by the
    SDK (distinct values, so a swapped or forgotten field shows)."""
    from duospec.coordinator.api import FinishReason, SpecStats
    from duospec.coordinator.serving.gateway import Delta
    from duospec.coordinator.serving.openai_protocol import usage
    from duospec.coordinator.serving.service import _response
    from duospec.sdk.types import chunk_from_proto
    from duospec.v1 import generation_pb2

    counts = [f.name for f in generation_pb2.SpeculationStats.DESCRIPTOR.fields if f.name != "mean_accepted_length"]
    assert "hedge_tokens_kept" in counts and "lookup_accepted" in counts
    stats = SpecStats(**{name: 100 + i for i, name in enumerate(counts)})
    response = _response(Delta(request_id="r", text="", token_ids=(), finish_reason=FinishReason.LENGTH,
                               prompt_tokens=3, completion_tokens=4, stats=stats))
    sdk = chunk_from_proto(response).stats
    speculation = usage(3, 4, stats)["speculation"]
    for i, name in enumerate(counts):
        assert getattr(response.stats, name) == 100 + i, name
        assert getattr(sdk, name) == 100 + i, name
    # the OpenAI usage object carries the ones a client tunes speculation by
    for name in ("drafted_tokens", "accepted_tokens", "target_forwards", "cache_lookups", "cache_hits", "tree_nodes",
                 "tree_hits", "lookup_tokens", "lookup_accepted", "hedge_tokens_kept"):
        assert speculation[name] == getattr(stats, name), name


def test_constraints_travel_in_the_request_and_only_one_at_a_time(server):
    from duospec.sdk import Client
    from duospec.sdk.types import build_request

    with Client(server.address) as client:
        client.generate("x", json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
        client.generate("x", grammar='start: "a"+')
    first, second = server.servicer.requests[-2:]
    assert json.loads(first.constraint.json_schema)["properties"]["a"] == {"type": "integer"}
    assert second.constraint.grammar == 'start: "a"+'
    with pytest.raises(sdk.InvalidArgument, match="one of json_schema, regex or grammar"):
        build_request("x", regex="a", grammar="start: x")
