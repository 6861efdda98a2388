"""Blocking client.

    with duospec.Client("127.0.0.1:50051", api_key=...) as client:
        result = client.generate("def fib(n):", max_new_tokens=64)
        for chunk in client.generate("def fib(n):", stream=True):
            print(chunk.text, end="", flush=True)

`address` may be a list of gateways; a generation whose stream breaks goes on from another
connection, resumed exactly (duospec/sdk/resume.py).
"""

from __future__ import annotations

import time
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


class GenerationStream:
    """Iterator of GenerationChunk for one generation, across reconnections when its stream breaks.
    Closing it (or leaving `with`) cancels the call, which frees the sequence on the server. Made by
    `Client.generate`, once the first message has arrived."""

    def __init__(self, client: Client, generation: Generation):
        self._client = client
        self._generation = generation
        self._call: Any = None
        self._pending: pb.GenerateResponse | None = self._connect()
        self._finished = False

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> GenerationChunk:
        if self._finished:
            raise StopIteration
        response, self._pending = self._pending, None
        if response is None:
            response = self._read()
        chunk = self._generation.received(response)
        self._finished = chunk.finish_reason is not None
        return chunk

    def _read(self) -> pb.GenerateResponse:
        response, error = _next(self._call)
        if response is not None:
            return response
        self._call.cancel()
        time.sleep(self._generation.broken(error))
        return self._connect()

    def _connect(self) -> pb.GenerateResponse:
        """Opens the call (resumed after what was delivered) and waits for its first message."""
        generation = self._generation
        while True:
            self._call = self._client._call_generate(generation)
            response, error = _next(self._call)
            if response is not None:
                return response
            time.sleep(generation.broken(error))

    def cancel(self) -> None:
        self._finished = True
        self._call.cancel()

    close = cancel

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class Client:
    """Blocking duospec client. `address`: a gateway's `host:port`, or a list of them (calls go to the
    last one that answered; a failed try moves to the next). `tls`: False (plaintext), True (system
    roots) or the server's root certificates as PEM bytes or a file path. `timeout` is the default
    per-call deadline in seconds. `resume`: a generation whose stream breaks goes on, resumed, from
    another connection (exact for greedy and seeded requests; an unseeded sampled one fails with
    `Unavailable`); False: the break is the caller's `Unavailable`."""

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
            self._channels = [grpc.insecure_channel(a, options=options) for a in address_list(address)]
        else:
            self._channels = [grpc.secure_channel(a, creds, options=options) for a in address_list(address)]
        self._stubs = [GenerationServiceStub(c) for c in self._channels]
        self._healths = [health_pb2_grpc.HealthStub(c) for c in self._channels]
        self._address = 0  # the one that answered last

    def generate(
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
    ) -> GenerationResult | GenerationStream:
        """Generates a completion. `mode` None = the model's default; `max_new_tokens` None = the
        server's default; `logprobs` N: each token's log p under the target plus N (<= 20) alternatives.
        `json_schema` (a dict or JSON text), `regex` or `grammar` (Lark): the output must match it.
        `resume` None = the client's setting. With stream=True returns a GenerationStream (blocks until
        the first chunk)."""
        request = build_request(
            prompt, prompt_token_ids=prompt_token_ids, messages=messages, model=model,
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, mode=mode,
            max_draft_tokens=max_draft_tokens, request_id=request_id, speculation_cache=speculation_cache,
            speculation_tree=speculation_tree, logprobs=logprobs,
            json_schema=json_schema, regex=regex, grammar=grammar,
        )
        chunks = GenerationStream(self, Generation(request, self._attempts(timeout),
                                                   self._resume if resume is None else bool(resume)))
        if stream:
            return chunks
        builder = ResultBuilder()
        with chunks:
            for chunk in chunks:
                builder.add(chunk)
        return builder.result()

    def models(self, *, timeout: float | None = None) -> list[ModelCard]:
        reply = self._unary(lambda i: self._stubs[i].ListModels, pb.ListModelsRequest(), timeout)
        return [model_card_from_proto(card) for card in reply.models]

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The server's grpc.health.v1 status name: "SERVING", "NOT_SERVING", ..."""
        request = health_pb2.HealthCheckRequest(service=service)
        reply = self._unary(lambda i: self._healths[i].Check, request, timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _attempts(self, timeout: float | None) -> Attempts:
        deadline = Deadline(timeout if timeout is not None else self._timeout)
        return Attempts(self._retry, deadline, len(self._stubs), self._address)

    def _call_generate(self, generation: Generation) -> Any:
        attempts = generation.attempts
        self._address = attempts.address
        return self._stubs[attempts.address].Generate(generation.request(), timeout=attempts.deadline.remaining(),
                                                      metadata=self._metadata)

    def _unary(self, method: Callable[[int], Callable], request: Any, timeout: float | None) -> Any:
        """`method(i)`: the call on address i. UNAVAILABLE is retried, on the next address."""
        attempts = self._attempts(timeout)
        while True:
            try:
                reply = method(attempts.address)(request, timeout=attempts.deadline.remaining(),
                                                 metadata=self._metadata)
            except grpc.RpcError as err:
                delay = attempts.retry_delay() if is_unavailable(err) else None
                if delay is None:
                    raise error_from_rpc(err) from None
                time.sleep(delay)
            else:
                self._address = attempts.address
                return reply


def _next(call) -> tuple[pb.GenerateResponse | None, grpc.RpcError | None]:
    """The call's next message, or None and what ended the call (None: it closed without a final message)."""
    try:
        return next(call), None
    except StopIteration:
        return None, None
    except grpc.RpcError as err:
        return None, err
