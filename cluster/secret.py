"""The per-deployment secret that authenticates the internal data plane (DESIGN.md §2).

The coordinator makes one secret when it starts a deployment and hands it to the draft and target
actors through Ray (a constructor argument, so a restarted actor keeps it). Every internal gRPC
stream carries it as call metadata; a worker compares it in constant time before the handler runs, so
a stranger on a worker port — or a coordinator of an older deployment — gets UNAUTHENTICATED and
changes nothing (no sequence released, no forward run).
"""

from __future__ import annotations

import hmac
import secrets

import grpc

METADATA_KEY = "x-duospec-deployment-secret"


def new_deployment_secret() -> str:
    return secrets.token_urlsafe(32)


def call_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    """What a coordinator sends with every internal stream."""
    return ((METADATA_KEY, secret),)


class DeploymentSecretInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose metadata lacks this deployment's secret."""

    def __init__(self, secret: str):
        if not secret:
            raise ValueError("an empty deployment secret would admit anyone; pass new_deployment_secret()")
        self._secret = secret.encode()

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "this worker serves one duospec deployment; the call did not carry its secret")

        self._refusal = grpc.unary_unary_rpc_method_handler(refuse)
        self._stream_refusal = grpc.stream_stream_rpc_method_handler(refuse)

    def intercept_service(self, continuation, handler_call_details):
        given = dict(handler_call_details.invocation_metadata or ()).get(METADATA_KEY, "")
        if hmac.compare_digest(given.encode(), self._secret):
            return continuation(handler_call_details)
        # Both internal services are bidirectional streams; anything else (e.g. health probes by
        # strangers) is refused the same way.
        return self._stream_refusal if handler_call_details.method.endswith(("/Draft", "/Verify")) else self._refusal
