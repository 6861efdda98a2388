"""The TargetWorker Ray actor: the target model plus its TargetService (verify) gRPC endpoint."""

from __future__ import annotations

from duospec.cluster.worker import GrpcModelWorker
from duospec.internal.v1 import pearl_pb2_grpc as pb_grpc
from duospec.target_worker.service import TargetServicer
from duospec.target_worker.verifier import Verifier


class TargetWorker(GrpcModelWorker):
    role = "target"

    def _serve(self, server) -> None:
        self.verifier = Verifier(self.runner, tokenizer_path=self.model_path)
        pb_grpc.add_TargetServiceServicer_to_server(TargetServicer(self.verifier), server)

    def stats(self) -> dict:
        return {
            **self.info(),
            "live_sequences": len(self.verifier.slots),
            "free_slots": self.runner.free_slots,
            "forwards": self.verifier.forwards,
            "tokens_verified": self.verifier.tokens_verified,
            **self.verifier.grammar_stats(),
            **self.runner.kv_stats(),
        }
