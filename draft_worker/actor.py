"""The DraftWorker Ray actor: the draft model plus its DraftService gRPC endpoint."""

from __future__ import annotations

from cluster.worker import GrpcModelWorker
from draft_worker.drafter import Drafter
from draft_worker.service import DraftServicer
from duospec.internal.v1 import pearl_pb2_grpc as pb_grpc


class DraftWorker(GrpcModelWorker):
    role = "draft"

    def _serve(self, server) -> None:
        self.drafter = Drafter(self.runner)
        pb_grpc.add_DraftServiceServicer_to_server(DraftServicer(self.drafter), server)

    def stats(self) -> dict:
        return {**self.info(), **self.drafter.stats()}
