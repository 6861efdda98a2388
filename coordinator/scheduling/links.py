"""Links from the scheduler to the two workers: in-process (threads) or gRPC streams.

Both kinds carry the same protobuf messages, so the scheduler cannot tell them apart: `send` never
blocks, `responses()` is an async iterator that ends (or raises) when the worker is gone. A gRPC
link pings its worker (HTTP/2 keepalive, cluster/keepalive.py): a worker whose process stops answering
without closing its socket (stopped, its node unreachable) breaks the stream instead of leaving it
open and silent forever.
"""

from __future__ import annotations

import asyncio
import enum
import queue
import threading
from typing import AsyncIterator, Awaitable, Callable, Protocol

import grpc

from duospec.cluster.keepalive import keepalive_options
from duospec.cluster.secret import InternalTls, call_metadata, internal_channel
from duospec.draft_worker.drafter import Drafter
from duospec.draft_worker.service import DraftLoop
from duospec.internal.v1 import pearl_pb2_grpc as pb_grpc
from duospec.target_worker.verifier import Verifier

_END = object()


class LinkLoss(enum.Enum):
    """Why the scheduler gave a worker's link up: what reconnecting must do about the worker."""

    CLOSED = "closed"  # its stream ended or broke: the process died and Ray restarts it; wait for that
    SILENT = "silent"  # open but silent while sequences wait (a stalled drafter): replace it unless it answers
    HUNG = "hung"  # a verify far past its predicted cost, or keepalive pings unanswered: replace it at once


Reconnect = Callable[[LinkLoss], Awaitable["Link"]]  # opens a link to the (replaced, restarted) worker, or raises


class Link(Protocol):
    """A bidirectional message stream to a worker (gRPC or in-process)."""

    def send(self, message) -> None: ...  # never blocks

    def responses(self) -> AsyncIterator: ...

    async def close(self) -> None: ...


def loss_of(exc: BaseException) -> LinkLoss:
    """How a worker's stream that raised `exc` was lost: HUNG when its keepalive pings went
    unanswered (gRPC ends the call UNAVAILABLE, "ping timeout" / "keepalive watchdog timeout"), else
    CLOSED."""
    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE:
        details = (exc.details() or "").lower()
        if "ping timeout" in details or "keepalive" in details:
            return LinkLoss.HUNG
    return LinkLoss.CLOSED


class _AsyncInbox:
    """Delivers messages from worker threads into the event loop that owns the link."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def put_threadsafe(self, message) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, message)
        except RuntimeError:  # the loop closed before the link did: nobody is left to read it
            if not self.loop.is_closed():
                raise

    async def iterate(self):
        while True:
            message = await self.queue.get()
            if message is _END:
                return
            yield message


class LocalDraftLink:
    """The drafter on a thread of this process (in-process decoding, tests, benchmarks)."""

    def __init__(self, drafter: Drafter):
        self.inbox = _AsyncInbox()
        self.loop = DraftLoop(drafter, self.inbox.put_threadsafe).start()

    def send(self, message) -> None:
        self.loop.submit(message)

    def responses(self):
        return self.inbox.iterate()

    async def close(self) -> None:
        await asyncio.to_thread(self.loop.stop)  # off the event loop: a stalled step may take a while
        if not self.loop.alive:  # a thread still stuck in a step keeps its slots until it returns
            self.loop.drafter.release_all()
        self.inbox.put_threadsafe(_END)


class LocalTargetLink:
    """The verifier on its own thread; batches are run in order, one at a time."""

    def __init__(self, verifier: Verifier):
        self.verifier = verifier
        self.inbox = _AsyncInbox()
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="duospec-target-loop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            batch = self.requests.get()
            if batch is _END:
                return
            try:
                result = self.verifier.run(batch)
            except Exception as exc:  # never leave the scheduler waiting for a verdict that won't come
                result = failed_batch(batch, exc)
            self.inbox.put_threadsafe(result)

    def send(self, message) -> None:
        self.requests.put(message)

    def responses(self):
        return self.inbox.iterate()

    async def close(self) -> None:
        self.requests.put(_END)
        await asyncio.to_thread(self.thread.join, 5.0)
        self.verifier.release_all()
        self.inbox.put_threadsafe(_END)


def failed_batch(batch, exc: Exception):
    """A VerdictBatch that reports every item of `batch` as failed."""
    from duospec.internal.v1 import pearl_pb2 as pb

    return pb.VerdictBatch(
        batch_id=batch.batch_id,
        errors=[
            pb.VerifyError(seq_id=item.seq_id, kind=pb.VERIFY_ERROR_KIND_BAD_REQUEST, message=f"target failed: {exc}")
            for item in batch.items
        ],
    )


class GrpcStreamLink:
    """A bidirectional gRPC stream (DraftService.Draft or TargetService.Verify) to a worker actor."""

    def __init__(self, endpoint: str, method: str, secret: str, tls: InternalTls | None = None, *,
                 hang_timeout_s: float):
        self.endpoint = endpoint
        self.channel = internal_channel(
            endpoint, tls,
            options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                     *keepalive_options(hang_timeout_s)],
        )
        self.outbox: asyncio.Queue = asyncio.Queue()
        metadata = call_metadata(secret)
        if method == "draft":
            self.call = pb_grpc.DraftServiceStub(self.channel).Draft(self._requests(), metadata=metadata)
        elif method == "verify":
            self.call = pb_grpc.TargetServiceStub(self.channel).Verify(self._requests(), metadata=metadata)
        else:
            raise ValueError(f"unknown stream {method!r}")

    async def _requests(self):
        while True:
            message = await self.outbox.get()
            if message is _END:
                return
            yield message

    def send(self, message) -> None:
        self.outbox.put_nowait(message)

    def responses(self):
        return self.call.__aiter__()

    async def close(self) -> None:
        self.outbox.put_nowait(_END)
        self.call.cancel()
        await self.channel.close()


async def wait_for_channel(endpoint: str, timeout: float, tls: InternalTls | None = None) -> None:
    """Raises a clear error if the worker's gRPC endpoint does not answer within `timeout` seconds."""
    async with internal_channel(endpoint, tls) as channel:
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise ConnectionError(f"worker gRPC endpoint {endpoint} did not answer within {timeout:.0f} s") from None


async def close_quietly(link) -> None:
    """Closes a link that is being replaced; a dead one may fail to close."""
    try:
        await link.close()
    except Exception:  # a dead link may fail to close; it is being replaced anyway
        pass


def verify_error(error):
    """The CoordinatorError a VerifyError from the target stands for."""
    from duospec.coordinator.api import CoordinatorError, InvalidRequest, Overloaded
    from duospec.internal.v1 import pearl_pb2 as pb

    if error.kind == pb.VERIFY_ERROR_KIND_SLOTS_EXHAUSTED:
        return Overloaded(f"the target has no free KV slot: {error.message}; retry shortly")
    if error.kind == pb.VERIFY_ERROR_KIND_CONTEXT_OVERFLOW:
        return InvalidRequest(error.message)
    if error.kind == pb.VERIFY_ERROR_KIND_GRAMMAR:  # the request's constraint left no legal token
        return InvalidRequest(error.message)
    return CoordinatorError(f"target rejected the sequence: {error.message}", code="INTERNAL")
