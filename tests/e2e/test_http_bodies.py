"""HTTP request bodies are bounded: the size limit applies while the body is read (413 before the rest
arrives, memory flat), JSON the parser cannot take is a 400, and the tenant is charged before parsing.
Through a real server, with a raw socket where the test needs to control how the body is sent."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import tracemalloc

import pytest

from duospec.coordinator.config import ServerSettings
from test_server_http import KEYS, MODEL, PROMPT, TENANTS, _free_port, chat_pair, client, harness  # noqa: F401
from server_support import running_server, server_coordinator

openai = pytest.importorskip("openai")

BODY = 64 << 20  # what the issue sent: 64 MiB
CHUNK = b"x" * (64 << 10)


def _send_and_read(port: int, headers: dict[str, str], body_chunks: int, *, chunked: bool) -> tuple[int, dict, int]:
    """POSTs to /v1/completions, sending up to `body_chunks` chunks of 64 KiB but stopping as soon as
    an answer is there to read; returns (status, JSON body, body bytes sent)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        head = "POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall((head + "\r\n").encode())
        sent = 0
        for i in range(body_chunks):
            if select.select([sock], [], [], 0)[0]:
                break
            data = (b'{"prompt": "' if i == 0 else b"") + CHUNK
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(data)
        sock.settimeout(30)
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += sock.recv(65536)
        head_bytes, _, rest = reply.partition(b"\r\n\r\n")
        lines = head_bytes.decode().split("\r\n")
        fields = dict(line.lower().split(": ", 1) for line in lines[1:])
        while len(rest) < int(fields["content-length"]):
            rest += sock.recv(65536)
        return int(lines[0].split()[1]), json.loads(rest), sent


class _PeakAllocated:
    """The most memory Python code in this process (the server's included) held at once while it is open,
    above what it held when it opened. Traced allocations, not the resident size: the resident size also
    moves with every other thread's allocator arenas in a long test session, which is noise here."""

    def __enter__(self):
        tracemalloc.start()
        self.before = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc):
        self.growth = tracemalloc.get_traced_memory()[1] - self.before
        tracemalloc.stop()


async def test_a_body_over_the_limit_is_413_before_it_is_read_and_memory_stays_flat(harness):
    port, limit = harness.server.http_port, harness.server.settings.max_request_body_bytes
    assert limit == 4 << 20  # the default, as gRPC's message limit
    key = {"authorization": f"Bearer {KEYS['alpha']}"}
    declared = {"content-length": str(BODY)}
    # A declared length: answered from the headers, before a byte of the body is sent; a caller without
    # a key is turned away before that too.
    status, body, sent = await asyncio.to_thread(_send_and_read, port, declared, 0, chunked=False)
    assert (status, sent) == (401, 0) and body["error"]["type"] == "authentication_error"
    status, body, sent = await asyncio.to_thread(_send_and_read, port, {**key, **declared}, 0, chunked=False)
    assert (status, sent) == (413, 0)
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert str(limit) in error["message"] and "max_request_body_bytes" in error["message"]
    # Chunked, no length: refused once the bytes read pass the limit, long before the 64 MiB are sent,
    # and never held whole.
    with _PeakAllocated() as held:
        status, body, sent = await asyncio.to_thread(
            _send_and_read, port, {**key, "transfer-encoding": "chunked"}, BODY // len(CHUNK), chunked=True)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert limit < sent < BODY, sent
    assert held.growth < 3 * limit, held.growth  # the limit's worth and read buffers, never the body (16x the limit)
    async with client(harness) as c:  # and it serves on
        assert (await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)).choices[0].text is not None


@pytest.mark.parametrize("raw, param", [
    ('{"model": "tiny", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", None),  # past the decoder's nesting
    ('{"model": "tiny", "prompt": "x", "temperature": 1' + "0" * 400 + "}", "temperature"),  # past a float
    ('{"model": "tiny", "prompt": "x", "top_p": -1' + "0" * 400 + "}", "top_p"),
    ('{"model": "tiny", "prompt": "x", "max_tokens": 1' + "0" * 5000 + "}", None),  # past Python's int digits
    ('{"model": "tiny", "prompt": "x", "seed": 1' + "0" * 400 + "}", "seed"),
])
async def test_json_the_parser_cannot_take_is_a_400_never_a_500(harness, raw, param):
    import httpx2 as httpx

    async with httpx.AsyncClient() as http:
        reply = await http.post(harness.base_url + "/completions", content=raw,
                                headers={"authorization": f"Bearer {KEYS['alpha']}"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


async def test_a_prompt_past_what_the_context_can_hold_is_refused_by_its_length(harness):
    bound = harness.server.gateway.max_prompt_chars[MODEL]
    async with client(harness) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.completions.create(model=MODEL, prompt="x" * (bound + 1), max_tokens=2)
        assert info.value.body["param"] == "prompt" and "characters cannot fit" in info.value.body["message"]
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model=MODEL, max_tokens=2,
                                            messages=[{"role": "user", "content": "x" * (bound + 1)}])
        assert info.value.body["param"] == "messages"


async def test_the_tenants_request_rate_is_charged_before_the_body_is_parsed(chat_pair):
    """`tight` may send one request a minute: a body that is not even JSON uses it up."""
    import httpx2 as httpx

    settings = ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=_free_port())
    async with running_server(server_coordinator(chat_pair), settings, tenants=TENANTS) as h:
        url = f"http://127.0.0.1:{h.server.http_port}/v1/completions"
        async with httpx.AsyncClient() as http:
            broken = await http.post(url, content="{not json", headers={"authorization": f"Bearer {KEYS['tight']}"})
            assert broken.status_code == 400
            valid = await http.post(url, json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
                                    headers={"authorization": f"Bearer {KEYS['tight']}"})
            assert valid.status_code == 429 and "requests_per_minute" in valid.json()["error"]["message"]
        for code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"):  # each counted once, as refused
            assert h.server.metrics.registry.get_sample_value(
                "duospec:request_refused_total", {"tenant": "tight", "code": code}) == 1
