"""The target's gRPC service: verify batches in, verdict batches out, strictly in order."""

from __future__ import annotations

import threading

from duospec.internal.v1 import pearl_pb2_grpc as pb_grpc
from duospec.target_worker.verifier import Verifier


class TargetServicer(pb_grpc.TargetServiceServicer):
    def __init__(self, verifier: Verifier):
        self.verifier = verifier
        self._lock = threading.Lock()  # one forward at a time, whatever the number of streams

    def Verify(self, request_iterator, context):
        with self._lock:
            self.verifier.release_all()  # a new coordinator stream: the old one's sequences are gone
        for batch in request_iterator:
            with self._lock:
                result = self.verifier.run(batch)
            yield result
