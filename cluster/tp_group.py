"""Tensor-parallel worker groups on Ray (docs/design.md#engine): a worker whose model is split over R
devices is R Ray actors on one node, joined by torch.distributed (NCCL on CUDA, gloo on CPU).

Rank 0 is the worker itself (TargetWorker or DraftWorker: it owns the gRPC stream to the coordinator).
Its constructor, through `start_group`:

  1. opens the group's rendezvous: a TCPStore on its node's IP, on a port the OS picks — a restarted
     group gets a fresh one, so nothing of the old group's address is reused;
  2. starts ranks 1..R-1 as `RankFollower` actors in the other bundles of its placement group (one
     bundle per rank, packed on one node), handing them the store's address;
  3. joins the process group, loads its shard while the others load theirs, and waits until each has;
  4. drives them through a TensorParallelRunner: every state-changing runner call is broadcast to their
     `follow` loops before it runs on rank 0.

The followers are rank 0's children, so Ray ends them when rank 0 dies. A follower that dies, or whose
loop fails, ends rank 0's process (`_group_lost`): Ray restarts rank 0 (max_restarts), whose
constructor starts the whole group afresh. To the coordinator that is a restarted target (or drafter),
recovered as any other (coordinator/scheduling/recovery.py).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

from duospec.cluster.runtime import node_ip, torch_threads_for_actor
from duospec.engine.tensor_parallel import TensorParallel, TensorParallelRunner, follow

log = logging.getLogger(__name__)

# Liveness is Ray's to tell (a dead rank ends the group), not a collective's timeout: an idle server's
# followers wait in a broadcast for as long as no request comes.
_COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class GroupLayout:
    """What rank 0 needs to start the rest of its group."""

    world: int  # ranks, rank 0 included
    placement_group: Any  # the Ray placement group holding every rank's bundle
    bundles: tuple[int, ...]  # [world - 1] the bundle of rank 1, 2, ...
    resources: dict  # what each follower asks of its bundle {"CPU": .., "GPU": ..}
    join_timeout_s: float = 300.0  # how long ranks wait for each other to join and to load


def backend_for(device: str) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def start_group(layout: GroupLayout, loader: Callable, load_kwargs: dict) -> tuple[TensorParallelRunner, list[dict]]:
    """Rank 0: starts the followers, joins the group, loads this rank's shard (`loader(tp=..., **load_kwargs)`,
    a picklable callable the followers call alike). Returns the runner the worker serves with and each
    follower's facts (rank, pid, node, GPUs). A follower that fails to load fails this with its error."""
    import ray
    import torch.distributed as dist
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    backend = backend_for(load_kwargs.get("device", "cpu"))
    host = node_ip()
    store = dist.TCPStore(host, 0, layout.world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=layout.join_timeout_s))
    followers = [
        ray.remote(RankFollower).options(
            num_cpus=layout.resources.get("CPU", 1), num_gpus=layout.resources.get("GPU", 0),
            max_restarts=0,  # the group restarts as a whole, through rank 0
            max_concurrency=2,  # `ready` answers while `run` follows
            scheduling_strategy=PlacementGroupSchedulingStrategy(layout.placement_group,
                                                                 placement_group_bundle_index=bundle),
        ).remote(loader, load_kwargs, rank, layout.world, (host, store.port), backend, layout.join_timeout_s)
        for rank, bundle in enumerate(layout.bundles, start=1)
    ]
    try:
        tp = join_group(store, 0, layout.world, backend)
        runner = loader(tp=tp, **load_kwargs)
        ranks = ray.get([f.ready.remote() for f in followers], timeout=layout.join_timeout_s)
    except BaseException as exc:
        # Rank 0's own load error names the problem; a broken link (a follower left the group) does
        # not: then the follower's error does.
        own = isinstance(exc, ValueError) and not isinstance(exc, ray.exceptions.RayError)
        cause = exc if own else (_follower_failure(followers) or exc)
        for follower in followers:
            ray.kill(follower, no_restart=True)
        if cause is exc:
            raise
        raise cause from None
    loops = [f.run.remote() for f in followers]
    threading.Thread(target=_watch, args=(loops,), name="duospec-tp-watch", daemon=True).start()
    return TensorParallelRunner(runner, tp, on_broken=_group_lost), ranks


def join_group(store, rank: int, world: int, backend: str) -> TensorParallel:
    import torch.distributed as dist

    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=_COLLECTIVE_TIMEOUT)
    # NCCL moves tensors between GPUs; the runner calls and load-time agreements are Python objects and
    # CPU integers, which travel beside it in a gloo group.
    control = dist.new_group(backend="gloo", timeout=_COLLECTIVE_TIMEOUT) if backend == "nccl" else None
    return TensorParallel(rank, world, None, control)


class RankFollower:
    """Rank 1..R-1 of a tensor-parallel group: joins rank 0's group, loads its shard, then makes rank
    0's runner calls until its process ends (with rank 0's)."""

    def __init__(self, loader: Callable, load_kwargs: dict, rank: int, world: int, address: tuple[str, int],
                 backend: str, join_timeout_s: float):
        import torch
        import torch.distributed as dist

        torch.set_num_threads(torch_threads_for_actor())
        self.rank = rank
        self.error: BaseException | None = None
        host, port = address
        store = dist.TCPStore(host, port, world, is_master=False, timeout=datetime.timedelta(seconds=join_timeout_s))
        self.tp = join_group(store, rank, world, backend)
        try:
            self.runner = loader(tp=self.tp, **load_kwargs)
        except BaseException as exc:
            # Leaving the group at once fails rank 0's next collective instead of leaving it waiting;
            # `ready` then hands it the cause.
            self.error = exc
            dist.destroy_process_group()

    def ready(self) -> dict:
        """This rank's facts once its shard is loaded; its load error otherwise."""
        import ray

        if self.error is not None:
            raise self.error
        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "pid": os.getpid(), "node_id": ctx.get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def run(self) -> None:
        follow(self.runner, self.tp)


def _follower_failure(followers: list) -> BaseException | None:
    """The first follower's own error (a load error names the problem; rank 0 only saw a broken link)."""
    import ray

    for follower in followers:
        try:
            ray.get(follower.ready.remote(), timeout=10)
        except ray.exceptions.RayTaskError as exc:
            return exc.cause if isinstance(exc.cause, BaseException) else exc
        except Exception:  # died or never started: nothing more telling than rank 0's own error
            continue
    return None


def _watch(loops: list) -> None:
    """Rank 0: the first follow loop to end (its process died, or a call failed on it) ends the group."""
    import ray

    ready, _ = ray.wait(loops, num_returns=1, timeout=None)
    try:
        ray.get(ready[0])
        reason = "its follow loop returned"
    except Exception as exc:
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    _group_lost(RuntimeError(f"tensor-parallel rank {loops.index(ready[0]) + 1} is gone ({reason})"))


def _group_lost(exc: BaseException) -> None:
    """Ends rank 0's process (and with it, as their owner, every follower): Ray restarts the group. The
    ranks may be out of step, so serving on could return wrong tokens or hang in a collective."""
    log.error("tensor-parallel group lost: %s; ending rank 0 for Ray to restart the group", exc)
    logging.shutdown()
    os._exit(1)
