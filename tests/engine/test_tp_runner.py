"""Rank 0's TensorParallelRunner: a call that fails alike on every rank is the caller's error; any other
failure leaves the ranks out of step and goes to `on_broken` (a Ray group ends its process there);
arguments a worker passes as protobuf repeated fields travel to the other ranks as lists; bookkeeping
calls travel with the next forward, in one broadcast, as they were when made."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from duospec.engine.errors import SlotsExhausted
from duospec.engine.tensor_parallel import TensorParallel, TensorParallelRunner
from duospec.internal.v1 import pearl_pb2 as pb


class FakeRunner:
    def __init__(self):
        self.calls = []

    def match_prefix(self, slot, start, tokens):
        self.calls.append(("match_prefix", slot, start, tokens))
        return start

    def forward(self, chunks):
        raise RuntimeError("Connection closed by peer")  # what gloo raises when a rank died

    def allocate_slot(self):
        raise SlotsExhausted("every slot is in use")


@pytest.fixture
def one_rank_group():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield TensorParallel(0, 1)
    finally:
        dist.destroy_process_group()


def test_only_a_failure_that_leaves_the_ranks_out_of_step_breaks_the_group(one_rank_group):
    broken = []
    group = TensorParallelRunner(FakeRunner(), one_rank_group, on_broken=broken.append)
    with pytest.raises(SlotsExhausted):
        group.allocate_slot()  # refused before any collective, on every rank alike
    assert broken == []
    with pytest.raises(RuntimeError, match="closed by peer"):
        group.forward([])
    assert [str(e) for e in broken] == ["Connection closed by peer"]


def test_protobuf_repeated_arguments_are_sent_as_lists(one_rank_group):
    runner = FakeRunner()
    item = pb.VerifyItem(context=[5, 6, 7])
    assert TensorParallelRunner(runner, one_rank_group).match_prefix(0, 2, item.context) == 2
    assert runner.calls == [("match_prefix", 0, 2, item.context)]  # rank 0 itself runs what it was given


def test_bookkeeping_calls_travel_with_the_next_forward_as_they_were_made(one_rank_group, monkeypatch):
    import duospec.engine.tensor_parallel as tensor_parallel

    sent = []
    monkeypatch.setattr(tensor_parallel, "_broadcast", lambda tp, message: sent.append(message))
    runner = FakeRunner()
    runner.forward = lambda chunks: "logits"
    group = TensorParallelRunner(runner, one_rank_group)
    tokens = [5, 6, 7]
    assert group.match_prefix(0, 2, tokens) == 2 and runner.calls  # made on rank 0 at once
    tokens.append(8)  # the caller reuses its list before the others hear of the call
    assert sent == []
    assert group.forward(["chunk"]) == "logits"
    assert sent == [[("match_prefix", (0, 2, [5, 6, 7]), {}), ("forward", (["chunk"],), {})]]
    group.close()
    assert sent[-1] == [None]
