"""Admission by free blocks (coordinator/scheduling/kv_budget.py): a sequence the target has not started goes only
while the target's last-reported free blocks hold it, oldest first; the oldest goes anyway when no
other sequence holds the target's blocks."""

from __future__ import annotations

from types import SimpleNamespace

from duospec.coordinator.scheduling.kv_budget import KVPreemption
from duospec.internal.v1 import pearl_pb2 as pb


def _seq(name: str, tokens: int, target_len: int = 0, started_at: float = 0.0):
    return SimpleNamespace(name=name, committed=[7] * tokens, target_len=target_len, started_at=started_at,
                           finish_reason=None)


def _names(seqs) -> list[str]:
    return [s.name for s in seqs]


def test_new_sequences_start_oldest_first_while_the_free_blocks_hold_them():
    kv = KVPreemption()
    running = _seq("running", 40, target_len=40)
    young, old, older = _seq("young", 10, started_at=3), _seq("old", 20, started_at=2), _seq("older", 40, started_at=1)
    live = [running, young, old, older]
    assert _names(kv.admit(live, live)) == _names(live) and kv.waiting_for_blocks == 0  # no report yet
    kv.observe(SimpleNamespace(HasField=lambda f: True, kv=pb.KVUsage(num_blocks=16, free_blocks=7, block_size=16)),
               "target")
    # older: 3 blocks + 1 to decode into = 4 of 7; old: 2 + 1 = 3 of the 3 left; young: 2 > 0 left
    assert _names(kv.admit(live, live)) == ["running", "old", "older"] and kv.waiting_for_blocks == 1
    kv.observe(SimpleNamespace(HasField=lambda f: True, kv=pb.KVUsage(num_blocks=16, free_blocks=3, block_size=16)),
               "target")
    assert _names(kv.admit(live, live)) == ["running", "old"] and kv.waiting_for_blocks == 2


def test_the_oldest_goes_when_nothing_else_holds_the_targets_blocks():
    kv = KVPreemption()
    kv.observe(SimpleNamespace(HasField=lambda f: True, kv=pb.KVUsage(num_blocks=16, free_blocks=0, block_size=16)),
               "target")
    first, second = _seq("first", 100, started_at=1), _seq("second", 5, started_at=2)
    assert _names(kv.admit([second, first], [first, second])) == ["first"] and kv.waiting_for_blocks == 1
    first.target_len = 100  # it started: now the other waits for blocks like any new one
    assert _names(kv.admit([second], [first, second])) == [] and kv.waiting_for_blocks == 1
