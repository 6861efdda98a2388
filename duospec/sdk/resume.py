"""One generation across connections: what the sync and async streams share when a stream breaks.

A stream breaks when its call fails with UNAVAILABLE (the gateway went away, the connection reset)
or ends without its final message. Before the first message nothing was delivered, and the request
is sent again as it is. After it, the generation goes on from the tokens delivered so far: the same
request again, with `resume = {usage_id, delivered_token_ids}` (docs/api.md, "Resuming a broken
stream"), on the next of the client's addresses. The server continues it exactly where greedy or
seeded (every draw is keyed by seed and position), so the caller sees one uninterrupted stream. An
unseeded sampled request cannot be continued exactly: its break is an `Unavailable` error saying so.
Tries and waits follow the client's RetryPolicy within the call's deadline (`transport.Attempts`).
"""

from __future__ import annotations

import grpc

from duospec.sdk.errors import DuospecError, Unavailable, error_from_rpc
from duospec.sdk.transport import Attempts
from duospec.sdk.types import GenerationChunk, chunk_from_proto
from duospec.v1 import generation_pb2 as pb

TRUNCATED_STREAM = "the server closed the stream before the final message (no finish_reason)"


class Generation:
    """A generate call's progress: the tokens delivered, the stream's usage id, the tries left.
    `resume` False: a broken stream that delivered tokens is an error (as before resuming existed)."""

    def __init__(self, request: pb.GenerateRequest, attempts: Attempts, resume: bool):
        self.original = request
        self.attempts = attempts
        self.resume = resume
        self.delivered: list[int] = []
        self.usage_id = ""
        self.responses = 0  # messages received, over every connection

    def request(self) -> pb.GenerateRequest:
        """What the next connection sends: the request, resumed after what was delivered."""
        if not self.responses:
            return self.original
        request = pb.GenerateRequest()
        request.CopyFrom(self.original)
        request.resume.usage_id = self.usage_id
        request.resume.delivered_token_ids.extend(self.delivered)
        return request

    def received(self, response: pb.GenerateResponse) -> GenerationChunk:
        self.responses += 1
        self.usage_id = response.usage_id or self.usage_id
        self.delivered.extend(response.token_ids)
        self.attempts.progressed()
        return chunk_from_proto(response)

    def broken(self, error: grpc.RpcError | None) -> float:
        """The stream failed with `error` (None: it ended without its final message). Returns how
        long to wait before connecting again, or raises the DuospecError the caller gets."""
        if error is not None and not _is_break(error):
            raise error_from_rpc(error)
        failure = error_from_rpc(error) if error is not None else DuospecError("INTERNAL", TRUNCATED_STREAM)
        if self.responses:
            self._check_resumable(failure)
        delay = self.attempts.retry_delay()
        if delay is None:
            raise failure
        return delay

    def _check_resumable(self, failure: DuospecError) -> None:
        if not self.resume or not self.usage_id:  # off, or a server that cannot resume: the failure as it was
            raise failure
        sampling = self.original.sampling
        if sampling.temperature > 0 and not sampling.HasField("seed"):
            raise Unavailable("UNAVAILABLE", f"the stream broke after {len(self.delivered)} tokens ({failure}) and "
                              "could not be resumed: the request is sampled without a seed, so no continuation "
                              "would match it; pass seed= to make its streams resumable", failure.details)


def _is_break(error: grpc.RpcError) -> bool:
    """The connection failed, not the request: UNAVAILABLE, or a stream reset under the call."""
    code = error.code() if hasattr(error, "code") else None
    if code == grpc.StatusCode.UNAVAILABLE:
        return True
    details = (error.details() if hasattr(error, "details") else "") or ""
    return code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) and "RST_STREAM" in details
