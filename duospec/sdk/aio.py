"""asyncio client: the same API as `Client`, with awaitable methods.

    async with duospec.AsyncClient("127.0.0.1:50051") as client:
        result = await client.generate("def fib(n):", max_new_tokens=64)
        async for chunk in await client.generate("def fib(n):", stream=True):
            print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duospec.sdk.errors import error_from_rpc, is_unavailable
from duospec.sdk.resume import Generation
from duospec.sdk.transport import (
    Attempts, Deadline, PemSource, RetryPolicy, TlsSetting, address_list, call_metadata, channel_credentials,
    channel_options, check_timeout,
)
from duospec.sdk.types import (
    GenerationChunk, GenerationResult, ModelCard, ResultBuilder, build_request, model_card_from_proto,
)
from duospec.v1 import generation_pb2 as pb
from duospec.v1.generation_pb2_grpc import GenerationServiceStub


class AsyncGenerationStream:
    """Async iterator of GenerationChunk for one generation, across reconnections when its stream
    breaks (as `GenerationStream`); `cancel()` / leaving `async with` cancels it."""

    def __init__(self, client: AsyncClient, generation: Generation):
        self._client = client
        self._generation = generation
        self._call: Any = None
        self._pending: pb.GenerateResponse | None = None
        self._finished = False

    async def _open(self) -> AsyncGenerationStream:
        self._pending = await self._connect()
        return self

    def __aiter__(self) -> AsyncGenerationStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        if self._finished:
            raise StopAsyncIteration
        response, self._pending = self._pending, None
        if response is None:
            response = await self._read()
        chunk = self._generation.received(response)
        self._finished = chunk.finish_reason is not None
        return chunk

    async def _read(self) -> pb.GenerateResponse:
        try:
            response = await self._call.read()
            error = None
        except grpc.RpcError as err:
            response, error = None, err
        if response is not None and response is not grpc.aio.EOF:
            return response
        self._call.cancel()
        await asyncio.sleep(self._generation.broken(error))
        return await self._connect()

    async def _connect(self) -> pb.GenerateResponse:
        """Opens the call (resumed after what was delivered) and waits for its first message."""
        generation = self._generation
        while True:
            self._call = self._client._call_generate(generation)
            try:
                first = await self._call.read()
                if first is not grpc.aio.EOF:
                    return first
                error = None
            except grpc.RpcError as err:
                error = err
            await asyncio.sleep(generation.broken(error))

    def cancel(self) -> None:
        self._finished = True
        self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


class AsyncClient:
    """asyncio duospec client; arguments as for `duospec.Client`. Create it inside a running loop."""

    def __init__(
        self,
        address: str | Sequence[str] = "127.0.0.1:50051",
        *,
        api_key: str | None = None,
        tls: TlsSetting = False,
        timeout: float | None = None,
        max_retries: int = 3,
        client_cert_chain: PemSource | None = None,
        client_private_key: PemSource | None = None,
        grpc_options: Sequence[tuple[str, object]] = (),
        resume: bool = True,
    ):
        self._retry = RetryPolicy(max_retries=max_retries)
        self._timeout = check_timeout(timeout)
        self._metadata = call_metadata(api_key)
        self._resume = bool(resume)
        creds = channel_credentials(tls, client_cert_chain, client_private_key)
        options = channel_options(tuple(grpc_options))
        if creds is None:
            self._channels = [grpc.aio.insecure_channel(a, options=options) for a in address_list(address)]
        else:
            self._channels = [grpc.aio.secure_channel(a, creds, options=options) for a in address_list(address)]
        self._stubs = [GenerationServiceStub(c) for c in self._channels]
        self._healths = [health_pb2_grpc.HealthStub(c) for c in self._channels]
        self._address = 0  # the one that answered last

    async def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Iterable[Any] | None = None,
        model: str = "",
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        mode: str | None = None,
        max_draft_tokens: int = 0,
        request_id: str = "",
        speculation_cache: bool | None = None,
        speculation_tree: bool | None = None,
        logprobs: int | None = None,
        json_schema: dict | str | None = None,
        regex: str | None = None,
        grammar: str | None = None,
        stream: bool = False,
        timeout: float | None = None,
        resume: bool | None = None,
    ) -> GenerationResult | AsyncGenerationStream:
        """As `Client.generate`; with stream=True returns an AsyncGenerationStream once the first
        chunk has arrived."""
        request = build_request(
            prompt, prompt_token_ids=prompt_token_ids, messages=messages, model=model,
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, mode=mode,
            max_draft_tokens=max_draft_tokens, request_id=request_id, speculation_cache=speculation_cache,
            speculation_tree=speculation_tree, logprobs=logprobs,
            json_schema=json_schema, regex=regex, grammar=grammar,
        )
        chunks = await AsyncGenerationStream(self, Generation(
            request, self._attempts(timeout), self._resume if resume is None else bool(resume)))._open()
        if stream:
            return chunks
        builder = ResultBuilder()
        async with chunks:
            async for chunk in chunks:
                builder.add(chunk)
        return builder.result()

    async def models(self, *, timeout: float | None = None) -> list[ModelCard]:
        reply = await self._unary(lambda i: self._stubs[i].ListModels, pb.ListModelsRequest(), timeout)
        return [model_card_from_proto(card) for card in reply.models]

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        request = health_pb2.HealthCheckRequest(service=service)
        reply = await self._unary(lambda i: self._healths[i].Check, request, timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _attempts(self, timeout: float | None) -> Attempts:
        deadline = Deadline(timeout if timeout is not None else self._timeout)
        return Attempts(self._retry, deadline, len(self._stubs), self._address)

    def _call_generate(self, generation: Generation) -> grpc.aio.UnaryStreamCall:
        attempts = generation.attempts
        self._address = attempts.address
        return self._stubs[attempts.address].Generate(generation.request(), timeout=attempts.deadline.remaining(),
                                                      metadata=self._metadata)

    async def _unary(self, method: Callable[[int], Callable], request: Any, timeout: float | None) -> Any:
        """As `Client._unary`."""
        attempts = self._attempts(timeout)
        while True:
            try:
                reply = await method(attempts.address)(request, timeout=attempts.deadline.remaining(),
                                                       metadata=self._metadata)
            except grpc.RpcError as err:
                delay = attempts.retry_delay() if is_unavailable(err) else None
                if delay is None:
                    raise error_from_rpc(err) from None
                await asyncio.sleep(delay)
            else:
                self._address = attempts.address
                return reply
