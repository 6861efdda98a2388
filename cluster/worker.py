"""What the two model actors share: load a model with one torch thread (or, split over a
tensor-parallel group, rank 0's shard: cluster/tp_group.py), host a gRPC servicer on this node, report
where they are."""

from __future__ import annotations

import functools
import os
import time
from concurrent import futures

import grpc

from duospec.cluster.keepalive import WORKER_KEEPALIVE_OPTIONS
from duospec.cluster.runtime import node_ip, torch_threads_for_actor
from duospec.cluster.secret import DeploymentSecretInterceptor, InternalTls
from duospec.cluster.tp_group import GroupLayout, start_group


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class GrpcModelWorker:
    """Base for DraftWorker and TargetWorker actors. Subclasses build their servicer in `_serve`."""

    role = "worker"

    def __init__(self, model_path: str, *, deployment_secret: str, device: str = "auto", dtype: str = "auto",
                 max_slots: int = 16, max_context: int | None = None, internal_tls: InternalTls | None = None,
                 kv=None, tensor_parallel: GroupLayout | None = None):
        """`kv`: the model's KV pool (a duospec.engine.loader.KVOptions; None = the engine's default);
        `tensor_parallel`: where the other ranks go when this worker is rank 0 of a group."""
        self.started_at = time.time()  # wall clock, comparable across the pair's processes (info())
        import torch

        torch.set_num_threads(torch_threads_for_actor())
        self.model_path = model_path
        self.device = resolve_device(device)
        loader = self._loader(model_path)
        options = dict(device=self.device, dtype=dtype, max_slots=max_slots, max_context=max_context, kv=kv)
        self.ranks: list[dict] = []  # the other ranks of this worker's tensor-parallel group
        if loader is None:
            self.runner = None
        elif tensor_parallel is None or tensor_parallel.world == 1:
            self.runner = loader(**options)
        else:
            self.runner, self.ranks = start_group(tensor_parallel, loader, options)
        self.loaded_at = time.time()  # weights and KV cache allocated (on every rank)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"duospec-{self.role}"),
            interceptors=[DeploymentSecretInterceptor(deployment_secret)],
            options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                     *WORKER_KEEPALIVE_OPTIONS],
        )
        self._serve(self.server)
        host = node_ip()
        if internal_tls is not None:  # mutual TLS: only the coordinator's certificate gets in
            self.port = self.server.add_secure_port(f"{host}:0", internal_tls.server_credentials())
        else:
            self.port = self.server.add_insecure_port(f"{host}:0")
        self._endpoint = f"{host}:{self.port}"
        self.server.start()

    def _loader(self, model_path: str):
        """What loads the worker's ModelRunner from load_model's options (None for a worker without a
        model); picklable, so a tensor-parallel group's other ranks load their shards with it."""
        from duospec.engine import load_model

        return functools.partial(load_model, model_path)

    def _serve(self, server) -> None:
        raise NotImplementedError

    def endpoint(self) -> str:
        return self._endpoint

    def info(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        return {
            "role": self.role,
            "endpoint": self._endpoint,
            "node_id": ctx.get_node_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "device": self.device,
            "pid": os.getpid(),
            "tensor_parallel_size": 1 + len(self.ranks),
            "ranks": self.ranks,  # ranks 1.. of its group: {rank, pid, node_id, gpu_ids}
            "model_path": self.model_path,
            "free_slots": self.runner.free_slots if self.runner is not None else None,
            "max_slots": self.runner.max_slots if self.runner is not None else None,
            "max_context": self.runner.max_context if self.runner is not None else None,
            "started_at": self.started_at,
            "loaded_at": self.loaded_at,
        }

    def health(self) -> bool:
        return True
