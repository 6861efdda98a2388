"""What the sync and async clients share: credentials, call metadata, deadlines and the retry rule.

Retry rule: UNAVAILABLE (and a generation's stream that breaks: duospec/sdk/resume.py) is retried at
most `max_retries` times in a row, with exponential backoff that never sleeps past the call's
deadline, each try on the next of the client's addresses (one address: the same one again, where
another gateway process sharing its port may answer). Once a generation has delivered tokens it is
retried only by resuming it, which continues it exactly.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

import grpc

from duospec.sdk.errors import InvalidArgument

PemSource = Union[bytes, str, os.PathLike]
TlsSetting = Union[bool, bytes, str, os.PathLike]


def _read_pem(field: str, source: PemSource | None) -> bytes | None:
    if source is None or isinstance(source, bytes):
        return source
    path = Path(source)
    try:
        return path.read_bytes()
    except OSError as err:
        raise InvalidArgument(
            "INVALID_ARGUMENT", f"{field}: cannot read PEM file {str(path)!r} ({err.strerror}); "
            "pass the PEM bytes or a readable file path"
        ) from None


def channel_credentials(
    tls: TlsSetting,
    client_cert_chain: PemSource | None = None,
    client_private_key: PemSource | None = None,
) -> grpc.ChannelCredentials | None:
    """None for plaintext; `tls=True` trusts the system roots; bytes/path = root certificates (PEM)."""
    if tls is False or tls is None:
        if client_cert_chain is not None or client_private_key is not None:
            raise InvalidArgument(
                "INVALID_ARGUMENT", "client_cert_chain/client_private_key need tls=True or root certificates"
            )
        return None
    roots = None if tls is True else _read_pem("tls", tls)
    chain = _read_pem("client_cert_chain", client_cert_chain)
    key = _read_pem("client_private_key", client_private_key)
    if (chain is None) != (key is None):
        raise InvalidArgument(
            "INVALID_ARGUMENT", "mutual TLS needs both client_cert_chain and client_private_key"
        )
    return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=chain)


def call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    if not api_key:
        return ()
    return (("authorization", f"Bearer {api_key}"),)


def check_timeout(timeout_s: float | None) -> float | None:
    if timeout_s is not None and not timeout_s > 0:
        raise InvalidArgument("INVALID_ARGUMENT", f"timeout must be > 0 seconds or None, got {timeout_s!r}")
    return timeout_s


class Deadline:
    """An absolute point in time derived from a relative timeout (None = no deadline)."""

    def __init__(self, timeout_s: float | None):
        check_timeout(timeout_s)
        self._end = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining(self) -> float | None:
        return None if self._end is None else max(0.0, self._end - time.monotonic())


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int = 3
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0

    def __post_init__(self):
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise InvalidArgument("INVALID_ARGUMENT", f"max_retries must be an integer >= 0, got {self.max_retries!r}")

    def delay_before_retry(self, retries_done: int, deadline: Deadline) -> float | None:
        """Seconds to sleep before the next attempt, or None when the budget or deadline is spent."""
        if retries_done >= self.max_retries:
            return None
        ceiling = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**retries_done)
        delay = random.uniform(ceiling / 2, ceiling)  # jitter: clients that failed together spread out
        remaining = deadline.remaining()
        if remaining is not None and delay >= remaining:
            return None
        return delay


def channel_options(extra: tuple[tuple[str, object], ...] = ()) -> list[tuple[str, object]]:
    # Generations can be long; keep the connection alive through idle NATs/load balancers.
    return [("grpc.keepalive_time_ms", 60_000), ("grpc.keepalive_permit_without_calls", 0), *extra]


def address_list(address: str | Sequence[str]) -> tuple[str, ...]:
    """The client's gateways: one `host:port`, or a list of them."""
    addresses = (address,) if isinstance(address, str) else tuple(address)
    if not addresses or not all(isinstance(a, str) and a for a in addresses):
        raise InvalidArgument("INVALID_ARGUMENT", f"address must be 'host:port' or a non-empty list of them, "
                              f"got {address!r}")
    return addresses


class Attempts:
    """One call's tries: which of `n` addresses the next goes to, and how long to wait before it.
    Tries go round the addresses from `first`; `retried()` moves on after a failure."""

    def __init__(self, policy: RetryPolicy, deadline: Deadline, n: int, first: int = 0):
        self.policy = policy
        self.deadline = deadline
        self.n = n
        self.address = first % n
        self.retries = 0  # failed tries since the last progress

    def retry_delay(self) -> float | None:
        """Seconds to wait before the next try (on the next address), or None when out of tries."""
        delay = self.policy.delay_before_retry(self.retries, self.deadline)
        if delay is not None:
            self.retries += 1
            self.address = (self.address + 1) % self.n
        return delay

    def progressed(self) -> None:
        """A try got somewhere (a stream delivered a message): a later failure starts a fresh count."""
        self.retries = 0
