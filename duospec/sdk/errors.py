"""Typed SDK exceptions, one class per gRPC status code a caller is expected to handle.

Every exception carries the status name (`code`), the server's message and `details`: the text
entries of the call's trailing metadata (e.g. `retry-after-s` on RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

from typing import Iterable, Mapping

import grpc


class DuospecError(Exception):
    """Base class: a failed call, with its gRPC status name (`"NOT_FOUND"`, ...)."""

    def __init__(self, code: str, message: str, details: Mapping[str, str] | None = None):
        super().__init__(code, message, dict(details or {}))
        self.code = code
        self.message = message
        self.details = dict(details or {})

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class InvalidArgument(DuospecError, ValueError):
    """The request is malformed (raised locally too, before anything is sent)."""


class Unauthenticated(DuospecError):
    """Missing or wrong API key."""


class PermissionDenied(DuospecError):
    """The API key is valid but may not use this model."""


class NotFound(DuospecError):
    """Unknown model."""


class ResourceExhausted(DuospecError):
    """A tenant limit or the server's queue is full; retry after `retry_after_s` when known."""

    @property
    def retry_after_s(self) -> float | None:
        raw = self.details.get("retry-after-s")
        try:
            return float(raw) if raw is not None else None
        except ValueError:
            return None


class DeadlineExceeded(DuospecError):
    """The call's timeout passed before the server finished."""


class Unavailable(DuospecError):
    """The server could not be reached, or is shutting down."""


class Cancelled(DuospecError):
    """The call was cancelled (by this client or the server)."""


_CLASS_BY_CODE: dict[str, type[DuospecError]] = {
    "INVALID_ARGUMENT": InvalidArgument,
    "UNAUTHENTICATED": Unauthenticated,
    "PERMISSION_DENIED": PermissionDenied,
    "NOT_FOUND": NotFound,
    "RESOURCE_EXHAUSTED": ResourceExhausted,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
    "UNAVAILABLE": Unavailable,
    "CANCELLED": Cancelled,
}


def error_for_status(
    code: str, message: str, trailing: Iterable[tuple[str, str | bytes]] = ()
) -> DuospecError:
    """The exception for status `code`; other codes (INTERNAL, UNKNOWN, ...) give the base class."""
    details = {key: value for key, value in trailing if isinstance(value, str)}
    return _CLASS_BY_CODE.get(code, DuospecError)(code, message, details)


def error_from_rpc(error: grpc.RpcError) -> DuospecError:
    """Converts a grpc (sync or aio) call error; works on any object with code/details/trailing_metadata."""
    status = error.code() if hasattr(error, "code") else None
    code = status.name if isinstance(status, grpc.StatusCode) else "UNKNOWN"
    message = (error.details() if hasattr(error, "details") else None) or str(error)
    trailing = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    return error_for_status(code, message, trailing or ())


def is_unavailable(error: grpc.RpcError) -> bool:
    return hasattr(error, "code") and error.code() == grpc.StatusCode.UNAVAILABLE
