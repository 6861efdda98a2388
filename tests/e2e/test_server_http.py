"""The OpenAI-compatible HTTP API through a real server, with the official `openai` package as client."""

from __future__ import annotations

import asyncio
import json

import pytest

from duospec.coordinator.config import ServerSettings
from duospec.coordinator.tenants.tenancy import Tenant, TenantLimits, hash_api_key, new_api_key
from duospec.v1 import generation_pb2 as pb
from exactness import hf_greedy, reference_model
from server_support import MAX_CONTEXT, MODEL, collect, running_server, server_coordinator

openai = pytest.importorskip("openai")

KEYS = {name: new_api_key() for name in ("alpha", "tight", "nomodels", "pair")}
TENANTS = [
    Tenant("alpha", key_hashes=(hash_api_key(KEYS["alpha"]),)),
    Tenant("tight", key_hashes=(hash_api_key(KEYS["tight"]),), limits=TenantLimits(requests_per_minute=1)),
    Tenant("nomodels", key_hashes=(hash_api_key(KEYS["nomodels"]),), allowed_models=("other",)),
    Tenant("pair", key_hashes=(hash_api_key(KEYS["pair"]),), limits=TenantLimits(max_concurrent_streams=2)),
]
PROMPT = "def fib(n):\n    return"


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    """The server tests' tiny pair, with a chat template (as chat checkpoints have)."""
    from transformers import AutoTokenizer

    from tiny_models import CHAT_TEMPLATE, make_tiny_checkpoint

    root = tmp_path_factory.mktemp("http-models")
    target = make_tiny_checkpoint(root / "target", "llama", seed=1, max_position_embeddings=MAX_CONTEXT)
    draft = make_tiny_checkpoint(root / "draft", "llama", seed=2, hidden_size=32, num_layers=1,
                                 max_position_embeddings=MAX_CONTEXT)
    for directory in (target, draft):
        tok = AutoTokenizer.from_pretrained(str(directory))
        tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(str(directory))
    return target, draft


@pytest.fixture
async def harness(chat_pair):
    settings = ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=_free_port())
    async with running_server(server_coordinator(chat_pair), settings, tenants=TENANTS) as h:
        h.base_url = f"http://127.0.0.1:{h.server.http_port}/v1"
        yield h


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client(h, key: str | None = "alpha", **kwargs) -> "openai.AsyncOpenAI":
    return openai.AsyncOpenAI(base_url=h.base_url, api_key=KEYS[key] if key else "none", max_retries=0, **kwargs)


async def grpc_ids(h, req: pb.GenerateRequest) -> list[int]:
    messages = await collect(h.stub, req, api_key=KEYS["alpha"])
    return [t for m in messages for t in m.token_ids]


async def test_completions_plain_and_streamed_match_grpc_and_transformers_in_every_mode(harness, chat_pair):
    from transformers import AutoTokenizer

    req = pb.GenerateRequest(prompt=PROMPT, stopping=pb.StoppingCriteria(max_new_tokens=20, ignore_eos=True))
    expected = await grpc_ids(harness, req)
    assert expected == hf_greedy(reference_model(chat_pair[0]),
                                 AutoTokenizer.from_pretrained(str(chat_pair[0])).encode(PROMPT), 20)
    async with client(harness) as c:
        for mode in ("off", "vanilla", "pearl"):
            extra = {"ignore_eos": True, "speculation": {"mode": mode}}
            done = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                              extra_body=extra)
            choice = done.choices[0]
            assert choice.token_ids == expected, mode
            assert choice.finish_reason == "length"
            assert (done.usage.completion_tokens, done.usage.total_tokens) == (20, done.usage.prompt_tokens + 20)
            assert done.usage.speculation["target_forwards"] > 0
            stream = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body=extra)
            chunks = [chunk async for chunk in stream]
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
            assert "".join(ch.choices[0].text for ch in chunks[:-1]) == choice.text
            assert [t for ch in chunks[:-1] for t in ch.choices[0].token_ids] == expected
            assert chunks[-2].choices[0].finish_reason == "length"


async def test_completion_prompt_as_token_ids_and_stop_string(harness):
    async with client(harness) as c:
        full = await c.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
        assert full.usage.prompt_tokens == 3
        text = full.choices[0].text
        assert len(text) > 4
        cut = await c.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=12, temperature=0,
                                         stop=[text[2:4]], extra_body={"ignore_eos": True})
        assert cut.choices[0].text == text[: text.index(text[2:4])]
        assert cut.choices[0].finish_reason == "stop"
        assert cut.usage.completion_tokens == len(cut.choices[0].token_ids) <= 12


async def test_chat_completions_plain_and_streamed_match_grpc(harness):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "fib please"}]
    req = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages]),
                             stopping=pb.StoppingCriteria(max_new_tokens=16, ignore_eos=True))
    grpc_messages = await collect(harness.stub, req, api_key=KEYS["alpha"])
    expected_text = "".join(m.text for m in grpc_messages)
    async with client(harness) as c:
        done = await c.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16,
                                               temperature=0, extra_body={"ignore_eos": True})
        assert done.choices[0].message.role == "assistant"
        assert done.choices[0].message.content == expected_text
        assert done.choices[0].token_ids == [t for m in grpc_messages for t in m.token_ids]
        assert done.usage.prompt_tokens == grpc_messages[-1].usage.prompt_tokens
        stream = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        chunks = [chunk async for chunk in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == expected_text
        assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None


async def test_sampled_requests_with_a_seed_repeat(harness):
    async with client(harness) as c:
        runs = [await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.95,
                                           seed=7, extra_body={"top_k": 40}) for _ in range(2)]
    assert runs[0].choices[0].token_ids == runs[1].choices[0].token_ids


async def test_top_p_0_is_greedy_and_a_negative_seed_is_its_64_bits(harness):
    """Both in OpenAI's ranges, and sent by clients: top_p 0 keeps the likeliest token alone; a signed
    64-bit seed is taken as its bits."""
    async def ids(**kwargs):
        async with client(harness) as c:
            reply = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, **kwargs)
        return reply.choices[0].token_ids

    assert await ids(temperature=0.9, top_p=0) == await ids(temperature=0)
    assert await ids(temperature=0.9, seed=-1) == await ids(temperature=0.9, seed=(1 << 64) - 1)


async def test_n_choices_are_n_requests_seeded_apart_plain_and_streamed(harness):
    """Choice i of a seeded request is the request alone with seed + i; streamed, each choice's chunks
    carry its index and add up to the plain choice; the usage counts the prompt once."""
    async with client(harness) as c:
        kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.9, seed=11,
                      extra_body={"ignore_eos": True})
        many = await c.completions.create(n=3, **kwargs)
        alone = [await c.completions.create(**{**kwargs, "seed": 11 + i}) for i in range(3)]
        assert [ch.index for ch in many.choices] == [0, 1, 2]
        assert [ch.token_ids for ch in many.choices] == [a.choices[0].token_ids for a in alone]
        assert len({tuple(ch.token_ids) for ch in many.choices}) > 1
        assert many.usage.prompt_tokens == alone[0].usage.prompt_tokens and many.usage.completion_tokens == 30
        chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0.9, seed=5)
        plain = await c.chat.completions.create(n=2, **chat)
        texts, finishes, usages = {}, {}, []
        async for chunk in await c.chat.completions.create(n=2, stream=True, stream_options={"include_usage": True},
                                                           **chat):
            for ch in chunk.choices:
                texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
                finishes[ch.index] = ch.finish_reason or finishes.get(ch.index)
            if chunk.usage is not None:
                usages.append(chunk.usage)
        assert [u.completion_tokens for u in usages] == [plain.usage.completion_tokens]
        assert texts == {i: ch.message.content for i, ch in enumerate(plain.choices)}
        assert finishes == {i: ch.finish_reason for i, ch in enumerate(plain.choices)}


async def test_more_choices_than_the_servers_slots_are_served_in_turn(chat_pair):
    """Each choice runs on its own: with more choices than generation slots, those admitted finish and
    make room for the rest (none waits holding a slot for another), plain and streamed."""
    settings = ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=_free_port(),
                              max_concurrent_requests=2)
    async with running_server(server_coordinator(chat_pair), settings, tenants=TENANTS) as h:
        h.base_url = f"http://127.0.0.1:{h.server.http_port}/v1"
        async with client(h, timeout=60) as c:
            plain = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=5, temperature=0)
            assert len(plain.choices) == 5 and len({tuple(ch.token_ids) for ch in plain.choices}) == 1
            ended = set()
            async for chunk in await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=5, stream=True):
                ended.update(ch.index for ch in chunk.choices if ch.finish_reason)
            assert ended == set(range(5))


async def test_n_choices_past_a_tenants_streams_are_refused_whole_and_release_all(harness):
    """Each choice is a stream of the tenant's: at two streams at most, n = 3 is refused whole (a 429),
    and the choices that were admitted are closed with it; n = 2 is served."""
    from server_support import wait_until_nothing_held

    async with client(harness, "pair") as c:
        with pytest.raises(openai.RateLimitError) as info:
            await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=50, n=3)
        assert "open streams" in info.value.body["message"]
        await wait_until_nothing_held(harness.server, harness.coordinator, MODEL)
        assert len((await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, n=2)).choices) == 2


async def test_cors_only_for_the_origins_configured(harness, chat_pair):
    """A browser's preflight is answered for a configured origin; without cors_allow_origins no
    cross-origin header is sent (browsers then refuse the call)."""
    import httpx2 as httpx

    preflight = {"origin": "https://ui.example.com", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    async with httpx.AsyncClient() as raw:
        refused = await raw.options(harness.base_url + "/chat/completions", headers=preflight)
        assert "access-control-allow-origin" not in refused.headers
        settings = ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=_free_port(),
                                  cors_allow_origins="https://ui.example.com, https://other.example.com")
        async with running_server(server_coordinator(chat_pair), settings, tenants=TENANTS) as h:
            base = f"http://127.0.0.1:{h.server.http_port}/v1"
            allowed = await raw.options(base + "/chat/completions", headers=preflight)
            assert allowed.status_code == 200
            assert allowed.headers["access-control-allow-origin"] == "https://ui.example.com"
            elsewhere = await raw.options(base + "/chat/completions", headers={**preflight, "origin": "https://evil.example"})
            assert elsewhere.headers.get("access-control-allow-origin") is None
            listed = await raw.get(base + "/models", headers={"origin": "https://ui.example.com",
                                                               "authorization": f"Bearer {KEYS['alpha']}"})
            assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == "https://ui.example.com"


async def test_two_gateways_share_the_http_and_grpc_ports(chat_pair):
    """`server.gateways: N` runs N processes on one port pair (SO_REUSEPORT): both bind it, and new
    connections are spread over them; without the option a second bind is refused."""
    import httpx2 as httpx

    settings = ServerSettings(host="127.0.0.1", port=_free_port(), metrics_port=0, http_port=_free_port())
    coordinators = [server_coordinator(chat_pair), server_coordinator(chat_pair)]
    async with running_server(coordinators[0], settings, tenants=TENANTS, reuse_port=True), \
            running_server(coordinators[1], settings, tenants=TENANTS, reuse_port=True):
        for _ in range(24):  # a connection each
            async with httpx.AsyncClient() as raw:
                reply = await raw.post(f"http://127.0.0.1:{settings.http_port}/v1/completions",
                                       headers={"authorization": f"Bearer {KEYS['alpha']}"},
                                       json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
                assert reply.status_code == 200
        served = [len(c.started) for c in coordinators]
        assert sum(served) == 24 and min(served) > 0, served
        with pytest.raises(OSError, match="could not bind"):
            async with running_server(server_coordinator(chat_pair), settings, tenants=TENANTS):
                pass


async def test_models_and_health(harness):
    async with client(harness) as c:
        listed = await c.models.list()
        assert [m.id for m in listed.data] == [MODEL]
    async with client(harness, "nomodels") as c:
        assert (await c.models.list()).data == []
    import httpx2 as httpx

    async with httpx.AsyncClient() as raw:
        health = await raw.get(harness.base_url.removesuffix("/v1") + "/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        missing = await raw.get(harness.base_url + "/nothing")
        assert missing.status_code == 404 and "error" in missing.json()


@pytest.mark.parametrize("kwargs, status, param", [
    ({"temperature": -1.0}, 400, "temperature"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"max_tokens": 100_000}, 400, "max_tokens"),
    ({"n": 0}, 400, "n"),
    ({"n": 129}, 400, "n"),
    ({"model": "no-such-model"}, 404, "model"),
    ({"extra_body": {"speculation": {"mode": "fast"}}}, 400, "speculation.mode"),
    ({"extra_body": {"frobnicate": 1}}, 400, "frobnicate"),
    ({"max_tokens": 5_000_000_000}, 400, "max_tokens"),  # past uint32: a 400, not a 500
    ({"top_p": -0.1}, 400, "top_p"),
    ({"seed": -(1 << 63) - 1}, 400, "seed"),
    ({"prompt": [1, 2, 1 << 40]}, 400, "prompt"),
    ({"extra_body": {"speculation": {"max_draft_tokens": 9}}}, 400, "speculation.max_draft_tokens"),  # cap 8
])
async def test_user_errors_are_openai_error_bodies_naming_the_field(harness, kwargs, status, param):
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **kwargs}
    async with client(harness) as c:
        with pytest.raises(openai.APIStatusError) as info:
            await c.completions.create(**args)
    err = info.value
    assert err.status_code == status
    body = err.body
    assert body["param"] == param and body["message"].startswith(param) and body["type"]
    if status == 404:
        assert MODEL in body["message"]  # lists what is served


async def test_auth_errors_and_rate_limit_with_retry_after(harness):
    async with client(harness, key=None) as c:
        with pytest.raises(openai.AuthenticationError) as info:
            await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert info.value.status_code == 401
    async with openai.AsyncOpenAI(base_url=harness.base_url, api_key="ds_wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    async with client(harness, "nomodels") as c:
        with pytest.raises(openai.PermissionDeniedError):
            await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    async with client(harness, "tight") as c:
        await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        with pytest.raises(openai.RateLimitError) as info:
            await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert int(info.value.response.headers["retry-after"]) >= 1


async def test_a_client_disconnect_mid_stream_frees_the_sequence(chat_pair):
    import httpx2 as httpx

    from server_support import TargetOnlyCoordinator

    slow = TargetOnlyCoordinator(*chat_pair, step_delay_s=0.02)  # the stream outlives the client
    settings = ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=_free_port())
    async with running_server(slow, settings) as h:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 240, "temperature": 0, "stream": True,
                "ignore_eos": True}
        url = f"http://127.0.0.1:{h.server.http_port}/v1/completions"
        async with httpx.AsyncClient(timeout=30) as raw:
            async with raw.stream("POST", url, json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                        break  # leave mid-stream: closing the response drops the connection
        metrics = h.server.metrics
        for _ in range(200):
            if slow.live == 0 and h.server.admission.running == 0:
                break
            await asyncio.sleep(0.02)
        assert slow.live == 0 and h.server.admission.running == 0
        assert metrics.request_success.labels("default", "cancelled")._value.get() == 1
        assert metrics.generation_tokens.labels("default")._value.get() < 240  # ended by the disconnect


async def test_http_off_and_grpc_unaffected(tiny_pair):
    settings = ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=0)
    async with running_server(server_coordinator(tiny_pair), settings) as h:
        assert h.server.http_port is None
        messages = await collect(h.stub, pb.GenerateRequest(prompt=PROMPT, stopping=pb.StoppingCriteria(
            max_new_tokens=2)))
        assert messages[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED


async def test_a_client_that_gives_up_on_a_plain_request_frees_the_sequence(chat_pair):
    import httpx2 as httpx

    from server_support import TargetOnlyCoordinator

    slow = TargetOnlyCoordinator(*chat_pair, step_delay_s=0.02)  # 240 tokens take seconds, whatever the machine
    settings = ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=_free_port())
    async with running_server(slow, settings) as h:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 240, "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=0.5) as raw:
            with pytest.raises(httpx.TimeoutException):
                await raw.post(f"http://127.0.0.1:{h.server.http_port}/v1/completions", json=body)
        metrics = h.server.metrics
        for _ in range(200):
            if metrics.request_success.labels("default", "cancelled")._value.get() == 1:
                break
            await asyncio.sleep(0.02)
        assert metrics.request_success.labels("default", "cancelled")._value.get() == 1
        assert metrics.generation_tokens.labels("default")._value.get() < 240
        assert slow.live == 0


async def test_logprobs_match_the_grpc_path_plain_and_streamed(harness, chat_pair):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_pair[0]))
    req = pb.GenerateRequest(prompt=PROMPT, stopping=pb.StoppingCriteria(max_new_tokens=12, ignore_eos=True),
                             logprobs=3)
    grpc_lps = [lp for m in await collect(harness.stub, req, api_key=KEYS["alpha"]) for lp in m.logprobs]
    async with client(harness) as c:
        done = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3,
                                          extra_body={"ignore_eos": True})
        lp = done.choices[0].logprobs
        assert lp.tokens == [tok.decode([x.token_id]) for x in grpc_lps]
        assert lp.token_logprobs == pytest.approx([x.logprob for x in grpc_lps], abs=1e-5)
        for top, x in zip(lp.top_logprobs, grpc_lps):  # a dict by token text: ids with the same text merge
            assert top == {tok.decode([t.token_id]): pytest.approx(t.logprob, abs=1e-5) for t in reversed(x.top)}
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        stream = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3,
                                            stream=True, extra_body={"ignore_eos": True})
        streamed = [v for ch in [x async for x in stream] if ch.choices and ch.choices[0].logprobs
                    for v in ch.choices[0].logprobs.token_logprobs]
        assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)
        messages = [{"role": "user", "content": "fib please"}]
        chat = await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                               logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
        content = chat.choices[0].logprobs.content
        assert len(content) == 8 and all(len(e.top_logprobs) == 2 for e in content)
        assert "".join(e.token for e in content) == chat.choices[0].message.content
        assert all(e.logprob <= 0 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, top_logprobs=2)
        assert info.value.body["param"] == "top_logprobs"


async def test_while_draining_new_requests_get_503_and_health_says_so(chat_pair):
    import httpx2 as httpx

    from server_support import TargetOnlyCoordinator

    slow = TargetOnlyCoordinator(*chat_pair, step_delay_s=0.02)
    settings = ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=_free_port(), grace_period_s=10)
    async with running_server(slow, settings) as h:
        base = f"http://127.0.0.1:{h.server.http_port}"
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=30) as raw:
            in_flight = asyncio.ensure_future(raw.post(base + "/v1/completions", json=body))
            while slow.live == 0:
                await asyncio.sleep(0.01)
            draining = asyncio.ensure_future(h.server.shutdown())
            await asyncio.sleep(0.1)
            refused = await raw.post(base + "/v1/completions", json=body)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"
            assert int(refused.headers["retry-after"]) >= 1
            assert (await raw.get(base + "/health")).status_code == 503
            finished = await in_flight  # the stream admitted before the drain still completes
            assert finished.status_code == 200 and finished.json()["usage"]["completion_tokens"] == 60
            await draining


async def test_logprobs_of_tokens_outside_top_k_are_a_finite_floor(harness):
    async with client(harness) as c:
        done = await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.7, seed=3,
                                          logprobs=5, extra_body={"top_k": 2})
    values = [v for top in done.choices[0].logprobs.top_logprobs for v in top.values()]
    assert min(values) == -9999.0 and all(v == -9999.0 or v > -50 for v in values)


async def test_a_lone_surrogate_in_the_prompt_is_a_400(harness):
    import httpx2 as httpx

    body = json.dumps({"model": MODEL, "prompt": "x\ud800y", "max_tokens": 2})  # valid JSON, invalid Unicode
    async with httpx.AsyncClient() as raw:
        reply = await raw.post(harness.base_url + "/completions", content=body,
                               headers={"authorization": f"Bearer {KEYS['alpha']}", "content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
