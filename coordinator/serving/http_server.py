"""The OpenAI-compatible HTTP front (Starlette on uvicorn), in the same process and event loop as gRPC.

    POST /v1/completions, POST /v1/chat/completions   (`stream: true` = server-sent events, ending
                                                        `data: [DONE]`; `stream_options.include_usage`)
    GET  /v1/models, GET /health

Every request goes through coordinator/serving/gateway.py, the path gRPC takes: the same keys
(`Authorization: Bearer`), limits, weighted queue, ledger and metrics. Translation lives in
coordinator/serving/openai_protocol.py. A client that disconnects ends its request (the gateway frees the
sequence's KV slots): for streams Starlette cancels the response, for plain requests a watcher on the
connection does.

A generation request is authenticated and charged to its tenant's requests/min from its headers
alone; only then is its body read, refused with 413 as soon as it passes
server.max_request_body_bytes (the rest is never held: uvicorn discards it), and parsed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from typing import Callable

from duospec.coordinator.serving import openai_protocol as oai
from duospec.coordinator.serving import openai_tools as oai_tools
from duospec.structured.tools import parse_tool_calls
from duospec.coordinator.config import TlsSettings
from duospec.coordinator.serving.gateway import Caller, Gateway, GatewayError

log = logging.getLogger("duospec.http")


class _SlowReader(Exception):
    """The client took no event for the server's send_timeout_s."""


def _closing_stream_class(send_timeout_s: float):
    from starlette.responses import StreamingResponse

    class ClosingStream(StreamingResponse):
        """Closes its event generator however the response ends: when the client disconnects while a
        chunk is being sent, Starlette cancels the send and leaves the generator suspended; closing it
        here (shielded) frees the sequence at once instead of whenever the garbage collector runs.
        A client that reads nothing for `send_timeout_s` (the connection's buffers full, each send
        waiting) ends the response the same way; uvicorn then closes the connection."""

        async def __call__(self, scope, receive, send):
            import anyio

            async def send_within(message):
                try:
                    await asyncio.wait_for(send(message), send_timeout_s)
                except asyncio.TimeoutError:
                    raise _SlowReader from None

            try:
                await super().__call__(scope, receive, send_within)
            except _SlowReader:
                log.warning("a streaming client read nothing for %.0f s; its stream is ended", send_timeout_s)
            finally:
                with anyio.CancelScope(shield=True):
                    await self.body_iterator.aclose()

    return ClosingStream


def create_app(gateway: Gateway, is_serving: Callable[[], bool]):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    _ClosingStream = _closing_stream_class(gateway.settings.send_timeout_s)

    def error_response(exc: GatewayError, **naming) -> JSONResponse:
        status, body, headers = oai.as_http_error(exc, **naming)
        return JSONResponse(body, status_code=status, headers=headers)

    def caller_of(request: Request) -> Caller:
        return gateway.authenticate(request.headers.get("authorization"))

    async def health(request: Request) -> Response:
        serving = is_serving()
        return JSONResponse({"status": "ok" if serving else "unavailable"}, status_code=200 if serving else 503)

    async def models(request: Request) -> Response:
        try:
            caller = caller_of(request)
        except GatewayError as exc:
            return error_response(exc)
        return JSONResponse(oai.model_list(gateway.visible_models(caller)))

    async def model(request: Request) -> Response:
        """GET /v1/models/{id}: one model the caller may use, as the list shows it; 404 otherwise."""
        try:
            caller = caller_of(request)
            name = request.path_params["name"]
            listed = oai.model_list([m for m in gateway.visible_models(caller) if m.name == name])["data"]
            if not listed:
                raise GatewayError("NOT_FOUND", f"no model {name!r} for this API key; GET /v1/models lists yours")
        except GatewayError as exc:
            return error_response(exc)
        return JSONResponse(listed[0])

    async def parse(request: Request, caller: Caller, chat: bool, naming: dict):
        """(GenerateRequest, ToolRequest | None, one call at most, choices, stream, include_usage) from the
        body; a GatewayError counted as refused."""
        try:
            body = oai.parse_body(await _read_body(request, gateway.settings.max_request_body_bytes))
            if chat and body.get("max_completion_tokens") is not None:
                naming["max_tokens_field"] = "max_completion_tokens"
            client_id = request.headers.get("x-request-id", "")
            req = oai.chat_request(body, client_id) if chat else oai.completion_request(body, client_id)
            tools = oai_tools.tool_request(body) if chat else None  # whether to look for tool calls
            naming["constraint_field"] = oai_tools.constraint_field(body, tools, chat=chat)
            single = body.get("parallel_tool_calls") is False
            return (req, tools, single, oai.choice_count(body), *oai.stream_options(body))
        except GatewayError as exc:
            raise gateway.refuse(caller, exc) from None

    async def generate(request: Request, *, chat: bool) -> Response:
        naming = {"chat": chat, "max_tokens_field": "max_tokens", "constraint_field": None}
        try:
            caller = await gateway.accept(request.headers.get("authorization"))
            req, tools, single, n, stream, include_usage = await parse(request, caller, chat, naming)
            # Each choice is a stream of its own, run on its own: one that waits for a slot never holds
            # the others' slots waiting for it (n choices wait for nothing but themselves).
            choices = [gateway.generate(caller, r) for r in oai.choice_requests(req, n)]
            if stream:
                # Errors before the first token are plain HTTP errors; a client that leaves while its
                # request waits in the queue or is prefilled gives its place up. The other choices
                # open as the stream runs (their errors are error events).
                first = await _until_disconnect(request, _first(choices[0], choices[1:]))
            else:
                results = await _until_disconnect(request, _all([_collect(deltas) for deltas in choices]))
                first = results[0][0]
        except GatewayError as exc:
            return error_response(exc, **naming)
        model = req.model or gateway.default_model
        rid = ("chatcmpl-" if chat else "cmpl-") + first.request_id
        created = int(time.time())

        def shape():
            return _LogprobShape(gateway.tokenizers[model], chat) if req.HasField("logprobs") else None

        if stream:
            finals: list = [None] * n
            chunks = [_choice_chunks(deltas, first if i == 0 else None, i, finals, rid, model, created, chat, shape(),
                                     oai_tools.StreamedCalls(single) if tools is not None else None)
                      for i, deltas in enumerate(choices)]
            return _ClosingStream(_events(chunks, finals, rid, model, created, chat, include_usage, naming),
                                  media_type="text/event-stream", headers={"cache-control": "no-cache"})

        def whole(index: int, final, text: str) -> dict:
            finish = oai.finish_reason(final.finish_reason)
            logprobs = shape()(final.logprobs) if req.HasField("logprobs") else None
            if chat and tools is not None:
                content, calls = parse_tool_calls(text, single=single)
                return oai.chat_object(rid, model, created, (content or None) if calls else text,
                                       oai_tools.finish_with_calls(finish, len(calls)), chunk=False, index=index,
                                       token_ids=final.token_ids, logprobs=logprobs,
                                       tool_calls=[oai_tools.tool_call_json(c, i) for i, c in enumerate(calls)])
            if chat:
                return oai.chat_object(rid, model, created, text, finish, chunk=False, index=index,
                                       token_ids=final.token_ids, logprobs=logprobs)
            return oai.completion_object(rid, model, created, text, finish, index=index, token_ids=final.token_ids,
                                         logprobs=logprobs)

        objects = [whole(i, final, text) for i, (final, text) in enumerate(results)]
        obj = {**objects[0], "choices": [o["choices"][0] for o in objects]}
        obj["usage"] = oai.choices_usage([final for final, _ in results])
        return JSONResponse(obj)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    middleware = []
    if gateway.settings.cors_allow_origins:
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware

        origins = [o.strip() for o in gateway.settings.cors_allow_origins.split(",") if o.strip()]
        middleware.append(Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST"],
                                     allow_headers=["*"], expose_headers=["Retry-After"]))
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={404: _not_found, 405: _not_allowed, 500: _server_error})


class _LogprobShape:
    """Turns deltas' logprobs into the API's JSON, counting text offsets across a completion's chunks."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat, self.offset = tokenizer, chat, 0

    def __call__(self, logprobs) -> dict:
        if self.chat:
            return oai.chat_logprobs(self.tokenizer, logprobs)
        shaped = oai.completion_logprobs(self.tokenizer, logprobs, self.offset)
        self.offset += sum(len(t) for t in shaped["tokens"])
        return shaped


async def _read_body(request, limit: int) -> bytes:
    """The body, or BodyTooLarge as soon as it is known to pass `limit` bytes: at once from a declared
    Content-Length, else at the chunk that crosses it. Nothing past the limit is kept."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise oai.BodyTooLarge(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise oai.BodyTooLarge(limit)
    return bytes(body)


async def _collect(deltas):
    """All deltas of a plain request: (the last delta, with every token id and logprob; the whole text)."""
    from dataclasses import replace

    async with contextlib.aclosing(deltas):
        first = await deltas.__anext__()
        parts, ids, logprobs, last = [first.text], list(first.token_ids), list(first.logprobs), first
        while last.finish_reason is None:
            last = await deltas.__anext__()
            parts.append(last.text)
            ids.extend(last.token_ids)
            logprobs.extend(last.logprobs)
    return replace(last, token_ids=tuple(ids), logprobs=tuple(logprobs)), "".join(parts)


async def _until_disconnect(request, work):
    """Runs `work`; cancels it (freeing the sequence) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise GatewayError("CANCELLED", "the client disconnected")
    return task.result()


async def _wait_disconnect(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _first(deltas, others: list):
    """The first delta of a stream's first choice; if it fails, the stream and the `others` (not yet
    started) are closed."""
    try:
        return await deltas.__anext__()
    except BaseException:
        for choice in (deltas, *others):
            with contextlib.suppress(Exception):
                await choice.aclose()
        raise


async def _all(awaitables: list) -> list:
    """asyncio.gather, but when one fails (or the caller is cancelled) the others are cancelled and
    waited for, so no choice goes on generating for nobody."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _choice_chunks(deltas, first, index: int, finals: list, rid: str, model: str, created: int, chat: bool,
                         shape: _LogprobShape | None, calls: oai_tools.StreamedCalls | None):
    """One choice's stream chunks (dicts, `index` in each), from its `first` delta (None: not yet read);
    its last delta goes into `finals[index]`.
    With `calls` (a chat request with tools) text inside <tool_call> blocks goes out as tool-call
    deltas instead of content."""
    async with contextlib.aclosing(deltas):
        delta, is_first = first or await deltas.__anext__(), True
        while True:
            finish = oai.finish_reason(delta.finish_reason)
            logprobs = shape(delta.logprobs) if shape and delta.logprobs else None
            if chat and calls is not None:
                content, tool_calls = calls.feed(delta.text, last=finish is not None)
                finish = oai_tools.finish_with_calls(finish, calls.calls)
                if is_first or content or tool_calls or delta.token_ids or finish:
                    yield oai.chat_object(rid, model, created, content or None, finish, chunk=True, index=index,
                                          first=is_first, token_ids=delta.token_ids, logprobs=logprobs,
                                          tool_calls=tool_calls)
            elif chat:
                if is_first or delta.text or delta.token_ids or finish:
                    yield oai.chat_object(rid, model, created, delta.text, finish, chunk=True, index=index,
                                          first=is_first, token_ids=delta.token_ids, logprobs=logprobs)
            elif delta.text or delta.token_ids or finish:
                yield oai.completion_object(rid, model, created, delta.text, finish, index=index,
                                            token_ids=delta.token_ids, logprobs=logprobs)
            is_first = False
            if finish is not None:
                break
            delta = await deltas.__anext__()
    finals[index] = delta


async def _merged(generators: list):
    """The items of several async generators as they come (one: as it is); closing this closes them all."""
    if len(generators) == 1:
        async with contextlib.aclosing(generators[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(generators))  # the client's pace holds them all back
    ended = object()

    async def pump(generator) -> None:
        try:
            async with contextlib.aclosing(generator):
                async for item in generator:
                    await queue.put((item, None))
            await queue.put((ended, None))
        except Exception as exc:
            await queue.put((None, exc))

    tasks = [asyncio.create_task(pump(g)) for g in generators]
    try:
        left = len(tasks)
        while left:
            item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is ended:
                left -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _events(choices: list, finals: list, rid: str, model: str, created: int, chat: bool, include_usage: bool,
                  naming):
    """The SSE events of a stream: its choices' chunks as they come, then the usage and [DONE]."""
    try:
        async with contextlib.aclosing(_merged(choices)) as chunks:
            async for chunk in chunks:
                yield oai.sse(chunk)
    except Exception as exc:  # mid-stream: the status line is gone, so the error is an event
        if not isinstance(exc, GatewayError):
            log.error("HTTP stream %s: internal error", rid, exc_info=exc)
            exc = GatewayError("INTERNAL", "internal error; see the server log")
        _, body, _ = oai.as_http_error(exc, **naming)
        yield oai.sse(body)
        yield oai.SSE_DONE
        return
    if include_usage:
        yield oai.sse(oai.usage_chunk(rid, model, created, chat=chat, usage_body=oai.choices_usage(finals)))
    yield oai.SSE_DONE


async def _not_found(request, exc):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": f"no route {request.url.path}; see GET /v1/models, POST "
                                              "/v1/completions, POST /v1/chat/completions, GET /health",
                                   "type": "not_found_error", "param": None, "code": "not_found"}}, status_code=404)


async def _not_allowed(request, exc):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": f"{request.method} is not allowed on {request.url.path}",
                                   "type": "invalid_request_error", "param": None, "code": "method_not_allowed"}},
                        status_code=405)


async def _server_error(request, exc):
    from starlette.responses import JSONResponse

    log.error("HTTP %s %s: internal error", request.method, request.url.path, exc_info=exc)
    return JSONResponse({"error": {"message": "internal error; see the server log", "type": "server_error",
                                   "param": None, "code": "internal"}}, status_code=500)


class HttpFront:
    """uvicorn in the running event loop, on a socket bound here (so port 0 works and errors are ours)."""

    def __init__(self, app, host: str, port: int, tls: TlsSettings | None = None, reuse_port: bool = False):
        import uvicorn

        class _Server(uvicorn.Server):
            def capture_signals(self):  # `duospec serve` owns SIGTERM/SIGINT (drain first)
                return contextlib.nullcontext()

        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                timeout_graceful_shutdown=2,
                                ssl_certfile=tls.cert_file if tls else None, ssl_keyfile=tls.key_file if tls else None,
                                ssl_ca_certs=tls.client_ca_file if tls else None,
                                ssl_cert_reqs=ssl.CERT_REQUIRED if tls and tls.client_ca_file else ssl.CERT_NONE)
        self._server = _Server(config)
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:  # the node's gateways share the port (coordinator/serving/gateways.py)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            self._sock.bind((host.strip("[]"), port))
        except OSError as exc:
            self._sock.close()
            raise OSError(f"could not bind the HTTP port {host}:{port} ({exc.strerror}); pick another with "
                          "--http-port, or 0 to turn HTTP off") from None
        self.port = self._sock.getsockname()[1]
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]), name="duospec-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), 5)
        except asyncio.TimeoutError:
            self._server.force_exit = True
            await self._task
        self._sock.close()
