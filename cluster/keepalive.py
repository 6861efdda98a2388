"""HTTP/2 keepalive on the internal streams (coordinator ⇄ workers), both ends of it.

The coordinator pings each worker's connection; a worker that answers no ping for about the model's
`hang_timeout_s` (its process stopped, hung in the kernel, its node unreachable — anything that
leaves the socket open but silent) breaks the stream, and the coordinator replaces the worker
(coordinator/scheduling/recovery.py). The ping is answered by gRPC's own threads, so a worker that is merely
busy in a long forward still answers it.
"""

from __future__ import annotations


def keepalive_options(hang_timeout_s: float) -> list[tuple[str, int]]:
    """The coordinator's channel options: a ping every half of `hang_timeout_s`, given up on after
    the other half."""
    half_ms = max(500, int(hang_timeout_s * 500))
    return [("grpc.keepalive_time_ms", half_ms), ("grpc.keepalive_timeout_ms", half_ms),
            # (gRPC times a ping out by its ping timeout too, a minute by default)
            ("grpc.http2.ping_timeout_ms", half_ms),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]


# The workers' server options: a coordinator pinging an idle stream every few seconds is expected,
# never a reason to close its connection (gRPC's default answers the third such ping with GOAWAY).
WORKER_KEEPALIVE_OPTIONS = [("grpc.http2.max_ping_strikes", 0), ("grpc.keepalive_permit_without_calls", 1)]
