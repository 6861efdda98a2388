"""Blocking client.

    with duospec.Client("127.0.0.1:50051", api_key=...) as client:
        result = client.generate("def fib(n):", max_new_tokens=64)
        for chunk in client.generate("def fib(n):", stream=True):
            print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duospec.sdk.errors import DuospecError, error_from_rpc, is_unavailable
from duospec.sdk.transport import (
    Deadline, PemSource, RetryPolicy, TlsSetting, call_metadata, channel_credentials, channel_options,
    check_timeout,
)
from duospec.sdk.types import (
    GenerationChunk, GenerationResult, ModelCard, ResultBuilder, build_request, chunk_from_proto,
    model_card_from_proto,
)
from duospec.v1 import generation_pb2 as pb
from duospec.v1.generation_pb2_grpc import GenerationServiceStub

TRUNCATED_STREAM = "the server closed the stream before the final message (no finish_reason)"


class GenerationStream:
    """Iterator of GenerationChunk for one call. Closing it (or leaving `with`) cancels the call,
    which frees the sequence on the server."""

    def __init__(self, call: Any, first: pb.GenerateResponse):
        self._call = call
        self._pending: pb.GenerateResponse | None = first
        self._finished = False

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> GenerationChunk:
        if self._finished:
            raise StopIteration
        response, self._pending = self._pending, None
        if response is None:
            try:
                response = next(self._call)
            except StopIteration:
                raise DuospecError("INTERNAL", TRUNCATED_STREAM) from None
            except grpc.RpcError as err:
                raise error_from_rpc(err) from None
        chunk = chunk_from_proto(response)
        self._finished = chunk.finish_reason is not None
        return chunk

    def cancel(self) -> None:
        self._finished = True
        self._call.cancel()

    close = cancel

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class Client:
    """Blocking duospec client. `tls`: False (plaintext), True (system roots) or the server's root
    certificates as PEM bytes or a file path. `timeout` is the default per-call deadline in seconds."""

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        *,
        api_key: str | None = None,
        tls: TlsSetting = False,
        timeout: float | None = None,
        max_retries: int = 3,
        client_cert_chain: PemSource | None = None,
        client_private_key: PemSource | None = None,
        grpc_options: Sequence[tuple[str, object]] = (),
    ):
        self._retry = RetryPolicy(max_retries=max_retries)
        self._timeout = check_timeout(timeout)
        self._metadata = call_metadata(api_key)
        creds = channel_credentials(tls, client_cert_chain, client_private_key)
        options = channel_options(tuple(grpc_options))
        if creds is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            self._channel = grpc.secure_channel(address, creds, options=options)
        self._stub = GenerationServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

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
    ) -> GenerationResult | GenerationStream:
        """Generates a completion. `mode` None = the model's default; `max_new_tokens` None = the
        server's default; `logprobs` N: each token's log p under the target plus N (<= 20) alternatives.
        `json_schema` (a dict or JSON text), `regex` or `grammar` (Lark): the output must match it.
        With stream=True returns a GenerationStream (blocks until the first chunk)."""
        request = build_request(
            prompt, prompt_token_ids=prompt_token_ids, messages=messages, model=model,
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, mode=mode,
            max_draft_tokens=max_draft_tokens, request_id=request_id, speculation_cache=speculation_cache,
            speculation_tree=speculation_tree, logprobs=logprobs,
            json_schema=json_schema, regex=regex, grammar=grammar,
        )
        chunks = self._open_stream(request, self._deadline(timeout))
        if stream:
            return chunks
        builder = ResultBuilder()
        with chunks:
            for chunk in chunks:
                builder.add(chunk)
        return builder.result()

    def models(self, *, timeout: float | None = None) -> list[ModelCard]:
        reply = self._unary(self._stub.ListModels, pb.ListModelsRequest(), self._deadline(timeout))
        return [model_card_from_proto(card) for card in reply.models]

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The server's grpc.health.v1 status name: "SERVING", "NOT_SERVING", ..."""
        request = health_pb2.HealthCheckRequest(service=service)
        reply = self._unary(self._health.Check, request, self._deadline(timeout))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _deadline(self, timeout: float | None) -> Deadline:
        return Deadline(timeout if timeout is not None else self._timeout)

    def _open_stream(self, request: pb.GenerateRequest, deadline: Deadline) -> GenerationStream:
        """Starts the call and waits for its first message; only up to here is UNAVAILABLE retried."""

        def attempt(timeout: float | None) -> GenerationStream:
            call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
            try:
                return GenerationStream(call, next(call))
            except StopIteration:
                raise DuospecError("INTERNAL", TRUNCATED_STREAM) from None

        return self._with_retries(attempt, deadline)

    def _unary(self, method: Callable, request: Any, deadline: Deadline) -> Any:
        return self._with_retries(
            lambda timeout: method(request, timeout=timeout, metadata=self._metadata), deadline
        )

    def _with_retries(self, attempt: Callable[[float | None], Any], deadline: Deadline) -> Any:
        retries = 0
        while True:
            try:
                return attempt(deadline.remaining())
            except grpc.RpcError as err:
                delay = self._retry.delay_before_retry(retries, deadline) if is_unavailable(err) else None
                if delay is None:
                    raise error_from_rpc(err) from None
            time.sleep(delay)
            retries += 1
