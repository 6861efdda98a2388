"""The per-deployment secret that authenticates the internal data plane (docs/design.md#processes-and-planes).

The coordinator makes one secret when it starts a deployment and hands it to the draft and target
actors through Ray (a constructor argument, so a restarted actor keeps it). Every internal gRPC
stream carries it as call metadata; a worker compares it in constant time before the handler runs, so
a stranger on a worker port — or a coordinator of an older deployment — gets UNAUTHENTICATED and
changes nothing (no sequence released, no forward run).
"""

from __future__ import annotations

import hmac
import pathlib
import secrets
from dataclasses import dataclass

import grpc

METADATA_KEY = "x-duospec-deployment-secret"


def new_deployment_secret() -> str:
    return secrets.token_urlsafe(32)


def call_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    """What a coordinator sends with every internal stream."""
    return ((METADATA_KEY, secret),)


def _refusals(secret: str, aio: bool) -> tuple[bytes, dict[str, grpc.RpcMethodHandler], grpc.RpcMethodHandler]:
    """The secret to compare, and the handlers that refuse a call without it, by the call's shape:
    the workers' Draft/Verify and a scheduler's Serve are bidirectional streams;
    anything else (e.g. health probes by strangers) is refused as a unary call. `aio`: for an asyncio
    server (its handlers are coroutines)."""
    if not secret:
        raise ValueError("an empty deployment secret would admit anyone; pass new_deployment_secret()")
    message = "this endpoint serves one duospec deployment; the call did not carry its secret"

    def refuse(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_async(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    handler = refuse_async if aio else refuse
    by_suffix = {"/Draft": grpc.stream_stream_rpc_method_handler(handler),
                 "/Verify": grpc.stream_stream_rpc_method_handler(handler),
                 "/Serve": grpc.stream_stream_rpc_method_handler(handler)}
    return secret.encode(), by_suffix, grpc.unary_unary_rpc_method_handler(handler)


def _admitted(secret: bytes, details) -> bool:
    given = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")
    return hmac.compare_digest(given.encode(), secret)


class DeploymentSecretInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose metadata lacks this deployment's secret (a worker's threaded server)."""

    def __init__(self, secret: str):
        self._secret, self._by_suffix, self._refusal = _refusals(secret, aio=False)

    def intercept_service(self, continuation, handler_call_details):
        if _admitted(self._secret, handler_call_details):
            return continuation(handler_call_details)
        method = handler_call_details.method
        return next((h for suffix, h in self._by_suffix.items() if method.endswith(suffix)), self._refusal)


class DeploymentSecretAioInterceptor(grpc.aio.ServerInterceptor):
    """The same for an asyncio server (a replica's scheduler actor, cluster/scheduler_actor.py)."""

    def __init__(self, secret: str):
        self._secret, self._by_suffix, self._refusal = _refusals(secret, aio=True)

    async def intercept_service(self, continuation, handler_call_details):
        if _admitted(self._secret, handler_call_details):
            return await continuation(handler_call_details)
        method = handler_call_details.method
        return next((h for suffix, h in self._by_suffix.items() if method.endswith(suffix)), self._refusal)


@dataclass(frozen=True)
class InternalTls:
    """Mutual TLS on the internal streams (serve config `server.internal_tls`): the workers serve
    with `cert`/`key` and accept only clients whose certificate `ca` signed; the coordinator presents
    the same certificate and checks the workers' against `ca`. The PEM bytes travel to the actors
    through Ray with the deployment secret, so the files need to exist only where `duospec serve` runs.
    Worker endpoints are node IPs, so the certificate is checked against `server_name` (a DNS SAN the
    certificate must carry), not against the IP."""

    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes
    server_name: str = "duospec-worker"

    @classmethod
    def from_files(cls, cert_file: str, key_file: str, ca_file: str, server_name: str = "duospec-worker"):
        read = lambda p: pathlib.Path(p).expanduser().read_bytes()  # noqa: E731
        return cls(read(cert_file), read(key_file), read(ca_file), server_name)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)]

    def __repr__(self) -> str:  # never the key in a log line
        return f"InternalTls(server_name={self.server_name!r})"


def internal_channel(endpoint: str, tls: InternalTls | None, options: list | None = None) -> grpc.aio.Channel:
    """The coordinator's channel to a worker: mutual TLS when the deployment has it."""
    options = list(options or [])
    if tls is None:
        return grpc.aio.insecure_channel(endpoint, options=options)
    return grpc.aio.secure_channel(endpoint, tls.channel_credentials(), options=options + tls.channel_options())
