"""The TargetWorker Ray actor: the target model plus its TargetService (verify) gRPC endpoint."""

from __future__ import annotations

from duospec.cluster.worker import GrpcModelWorker
from duospec.internal.v1 import pearl_pb2_grpc as pb_grpc
from duospec.target_worker.service import TargetServicer
from duospec.target_worker.verifier import Verifier


class TargetWorker(GrpcModelWorker):
    role = "target"

    def __init__(self, model_path: str, feature_layers: tuple[int, ...] = (), **kwargs):
        """`feature_layers`: the layers whose inputs make the features verdicts carry (an EAGLE-3
        drafter's; duospec/engine/eagle3.py); () sends the final hidden states (EAGLE, Medusa)."""
        super().__init__(model_path, **kwargs)
        from duospec.engine.eagle3 import tap_features

        tap_features(self.runner, feature_layers)  # rank 0 alone sends features

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
