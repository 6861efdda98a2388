"""The DraftWorker Ray actor: a drafting method (draft_worker/methods.py) plus its DraftService gRPC
endpoint. Only the model methods load a checkpoint (and ask for a GPU); the n-gram drafter needs none."""

from __future__ import annotations

import functools

from duospec.cluster.worker import GrpcModelWorker
from duospec.draft_worker.drafter import Drafter
from duospec.draft_worker.methods import build_proposer, load_draft_runner
from duospec.draft_worker.proposer import DraftSpec
from duospec.draft_worker.service import DraftServicer
from duospec.internal.v1 import pearl_pb2_grpc as pb_grpc


class DraftWorker(GrpcModelWorker):
    role = "draft"

    def __init__(self, spec: DraftSpec, target_path: str, prefill_chunk_tokens: int | None = None, **kwargs):
        self.spec = spec
        self.target_path = target_path
        self.prefill_chunk_tokens = prefill_chunk_tokens
        super().__init__(spec.checkpoint(target_path) or "", **kwargs)

    def _loader(self, model_path: str):
        if not self.spec.method.needs_model:
            return None
        return functools.partial(load_draft_runner, self.spec, self.target_path)

    def _serve(self, server) -> None:
        self.drafter = Drafter(build_proposer(self.spec, self.target_path, runner=self.runner, device=str(self.device),
                                              prefill_chunk_tokens=self.prefill_chunk_tokens),
                               tokenizer_path=self.target_path)
        pb_grpc.add_DraftServiceServicer_to_server(DraftServicer(self.drafter), server)

    def info(self) -> dict:
        return {**super().info(), "draft_method": self.spec.method.value}

    def stats(self) -> dict:
        return {**self.info(), **self.drafter.stats()}
