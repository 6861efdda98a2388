"""Tensor parallelism in the engine: a TP=2 and a TP=4 forward (gloo, one process per rank) give the
same logits as TP=1 for prefill, decode, ragged batches, token trees and rollbacks; sizes that do not
divide the model are refused naming the sizes that work; the HF fallback refuses TP > 1."""

from __future__ import annotations

import multiprocessing
import os
import socket

import pytest
import torch

from duospec.engine import SlotChunk
from duospec.engine.errors import CheckpointError
from duospec.engine.loader import load_model
from duospec.engine.tensor_parallel import (
    TensorParallel,
    TensorParallelRunner,
    check_tp_size,
    follow,
    working_tp_sizes,
)
from tiny_models import make_tiny_checkpoint

TOLERANCE = 1e-5  # fp32: a row-parallel sum adds the same terms in another order


def script(runner) -> list[torch.Tensor]:
    """The calls a worker makes: a ragged prefill, decode next to a multi-token chunk, a rollback, a
    token tree, keeping one path, and decoding after it; every logits row they return, and the final
    hidden states of a forward, then the EAGLE-3 taps of the next."""
    out: list[torch.Tensor] = []
    a, b = runner.allocate_slot(), runner.allocate_slot()
    out += runner.forward([SlotChunk(a, 0, [5, 9, 14, 3, 7, 21, 8]), SlotChunk(b, 0, [11, 4, 30])])
    out += runner.forward([SlotChunk(a, 7, [12]), SlotChunk(b, 3, [6, 2, 19, 25])])
    runner.truncate(b, 5)  # rollback: the last two drafts rejected
    out += runner.forward([SlotChunk(b, 5, [17, 23, 29, 31], parents=[-1, 0, -1, 2])])  # two branches
    runner.keep_path(b, 5, [2, 3])
    out += runner.forward([SlotChunk(b, 7, [13]), SlotChunk(a, 8, [1, 2])])
    logits, hidden = runner.forward_with_hidden([SlotChunk(a, 10, [40, 41])])
    out += logits + hidden
    runner.set_feature_layers((0, 1))  # an EAGLE-3 drafter's taps (rank 0 alone sends features)
    logits, taps = runner.forward_with_hidden([SlotChunk(b, 8, [42, 43])])
    out += logits + taps
    runner.free_slot(a)
    return [t.detach().clone() for t in out]


def _rank_main(path: str, rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        tp = TensorParallel(rank, world)
        runner = load_model(path, max_slots=4, max_context=64, backend="lean", tp=tp)
        if rank == 0:
            group = TensorParallelRunner(runner, tp)
            try:
                results.put([t.numpy() for t in script(group)])
            finally:
                group.close()
        else:
            follow(runner, tp)
    except BaseException as exc:  # the parent reports it instead of waiting for a result
        results.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise
    finally:
        dist.destroy_process_group()
    # A rank that returned normally was seen, about one run in ten, to abort after this point
    # ("terminate called without an active exception", exit -6) while torch's and gloo's static
    # objects are torn down at interpreter exit, its result already sent. Its work is done and
    # checked: flush the queue and leave without that teardown.
    results.close()
    results.join_thread()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(path, world: int) -> list[torch.Tensor]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(str(path), r, world, port, results)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = results.get(timeout=240)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert not isinstance(got, str), got
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [torch.from_numpy(x) for x in got]


@pytest.mark.parametrize("family, world, kv_heads", [("llama", 2, 2), ("qwen2", 2, 2), ("llama", 4, 4),
                                                     ("gemma3", 2, 2)])  # gemma3: q/k norms, norms after o and down
def test_tensor_parallel_forward_matches_one_process(tmp_path_factory, family, world, kv_heads):
    # An odd vocabulary, so the LM head's slices are padded.
    path = make_tiny_checkpoint(tmp_path_factory.mktemp(f"tp-{family}-{world}"), family, num_kv_heads=kv_heads,
                                num_heads=4, vocab_size=301, seed=3)
    want = script(load_model(path, max_slots=4, max_context=64, backend="lean"))
    got = run_group(path, world)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, (i, g.shape, w.shape)
        assert torch.allclose(g, w, atol=TOLERANCE, rtol=0), (i, (g - w).abs().max().item())


def test_sizes_that_do_not_divide_the_model_are_refused_naming_those_that_do(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "llama", num_heads=4, num_kv_heads=2, intermediate_size=128)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    assert working_tp_sizes(config) == [1, 2]
    check_tp_size(config, 2)
    with pytest.raises(CheckpointError, match=r"tensor_parallel_size=4 does not divide .*sizes that work: 1, 2"):
        check_tp_size(config, 4)
    with pytest.raises(CheckpointError, match="tensor_parallel_size=4"):
        load_model(path, max_slots=2, max_context=32, tp=TensorParallel(0, 4))


def test_the_transformers_fallback_refuses_tensor_parallelism(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "llama")
    with pytest.raises(CheckpointError, match="needs duospec's own forward.*tensor_parallel_size: 1"):
        load_model(path, max_slots=2, max_context=32, backend="hf", tp=TensorParallel(0, 2))
