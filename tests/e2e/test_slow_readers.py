"""A client that opens a stream and stops reading: once the connection's buffers are full, each send
waits on it, and past `server.send_timeout_s` the stream ends as a cancelled one does — its KV slots
and admission ticket are free again (the next request gets the server's only slot). Through a real
gRPC server and the HTTP server-sent-events front, on the in-process coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import grpc
import pytest

from duospec.coordinator.config import ServerSettings
from duospec.v1 import generation_pb2 as pb
from duospec.v1 import generation_pb2_grpc as pb_grpc
from server_support import (
    MODEL, collect, request, running_server, server_coordinator, wait_until_nothing_held,
)

SEND_TIMEOUT_S = 1.0
N_NEW = 240  # with logprobs, far more than the few KB a client that reads nothing lets through


def _settings(http_port: int = 0) -> ServerSettings:
    # One generation slot: the next request runs only once the stalled stream has let its slot go.
    return ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=http_port,
                          send_timeout_s=SEND_TIMEOUT_S, max_concurrent_requests=1)


async def _stalled_then_freed(h) -> None:
    """Waits until the stalled stream is admitted, then until it holds nothing any more (past the
    bound, not before), and checks that the server's one slot serves the next request."""
    deadline = time.monotonic() + 30
    while h.server.admission.running < 1:
        assert time.monotonic() < deadline, "the stream was never admitted"
        await asyncio.sleep(0.01)
    admitted = time.monotonic()
    await wait_until_nothing_held(h.server, h.coordinator, MODEL, within_s=SEND_TIMEOUT_S + 20)
    assert time.monotonic() - admitted >= SEND_TIMEOUT_S - 0.1
    assert len(await collect(h.stub, request(max_new_tokens=4))) >= 1


async def test_a_grpc_client_that_stops_reading_loses_its_stream_and_its_slots(tiny_pair):
    async with running_server(server_coordinator(tiny_pair), _settings()) as h:
        # A client that grants the server no more than ~1 KB it has not read (no window growth).
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{h.server.port}", options=[
            ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)])
        try:
            stalled = pb_grpc.GenerationServiceStub(channel).Generate(pb.GenerateRequest(
                prompt="def fib(n):", logprobs=5, stopping=pb.StoppingCriteria(max_new_tokens=N_NEW, ignore_eos=True),
            ), timeout=120)
            await _stalled_then_freed(h)
            # Reading at last, the client gets what was sent, then the end of its stream.
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                async for message in stalled:
                    received.extend(message.token_ids)
            assert ended.value.code() == grpc.StatusCode.CANCELLED and "send_timeout_s" in ended.value.details()
            assert 0 < len(received) < N_NEW  # it did stop mid-stream
        finally:
            await channel.close()


async def test_an_http_streaming_client_that_stops_reading_loses_its_stream_and_its_slots(tiny_pair):
    async with running_server(server_coordinator(tiny_pair), _settings(http_port=_free_port())) as h:
        # Loopback's 64 KB segments let the kernel grow a connection's send buffer to megabytes for a
        # client that reads nothing, more than the tiny model's longest answer: a small fixed one on
        # the listening socket (each connection inherits it) makes the stall show within one answer.
        h.server._http._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        with contextlib.closing(_post_and_never_read(h.server.http_port)) as sock:
            await _stalled_then_freed(h)
            sock.setblocking(False)  # what reached the client: the start of the stream, not its end
            received = b""
            with contextlib.suppress(BlockingIOError):
                while chunk := sock.recv(1 << 16):
                    received += chunk
            assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received


def _post_and_never_read(port: int) -> socket.socket:
    """A connection with a small receive buffer that posts a streaming completion and reads nothing."""
    body = json.dumps({"model": MODEL, "prompt": "def fib(n):", "max_tokens": N_NEW, "stream": True,
                       "logprobs": 20, "ignore_eos": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
    return sock


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_send_timeout_is_a_validated_server_setting():
    from duospec.coordinator.config import ConfigError, parse_serve_config

    def parsed(**server):
        return parse_serve_config({"server": server, "models": [{"name": "m", "target": "t"}]}).server

    assert parsed().send_timeout_s == ServerSettings.send_timeout_s
    assert parsed(send_timeout_s=5).send_timeout_s == 5.0
    with pytest.raises(ConfigError, match=r"server\.send_timeout_s: 0 is out of range"):
        parsed(send_timeout_s=0)
