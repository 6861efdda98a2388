"""The coordinator's side of the workers' paged KV caches: whose cached prompt blocks a request may
reuse (the salt every sequence carries to both workers), and preemption when the target runs out.

Prefix caching scopes (`models[].prefix_cache`):
    tenant   (default) a request reuses blocks cached for earlier requests of its own tenant only: a
             cache shared across tenants is a timing side channel (a fast first token tells a tenant
             that someone else sent that prompt) — vLLM's per-request cache_salt, set per tenant
    shared   one cache for every request of the model (one team, or prompts that are public anyway)
    off      the workers load with prefix caching off (nothing hashed, nothing reused)
"""

from __future__ import annotations

import time
from typing import Iterable, Protocol

from duospec.coordinator.api import Overloaded

PREFIX_CACHE_SCOPES = ("tenant", "shared", "off")


def cache_salt(scope: str, tenant: str) -> str:
    """The salt of a request's cached blocks under `scope`."""
    return f"tenant:{tenant}" if scope == "tenant" else ""


class Drafter(Protocol):
    """What preemption asks of the drafter's channel (coordinator/scheduling/draft_commands.py DraftChannel)."""

    up: bool

    def free(self, seq) -> None: ...

    def start(self, seq) -> None: ...


class KVPreemption:
    """Preemption by recompute, when the target's KV pool runs out mid-decode (docs/design.md#engine).

    The target answers an item it cannot hold with KV_CACHE_FULL (nothing of it changed). After such
    a batch the scheduler preempts one running sequence — the lowest priority weight, the youngest
    among equals, possibly one of those items': its blocks are freed on both workers (the target
    releases it with the next batch, the drafter gets a RELEASE) and it waits, holding its committed
    tokens. The items' other sequences go again in the next batch. A preempted
    sequence resumes when another sequence ends (oldest preempted first): the target re-prefills its
    committed tokens (mostly from the prefix cache, which kept their blocks) and the drafter starts it
    over, in a new epoch. Nothing committed changes; the client sees a pause.

    Owns the count of preemptions and the workers' KV pools as their latest batches reported them;
    the sequences and the drafter's channel are the scheduler's, passed in.
    """

    def __init__(self):
        self.num_preemptions = 0
        # the workers' KV pools as their latest batches reported them (pearl.proto KVUsage; None: not yet)
        self.target_kv = None
        self.draft_kv = None
        self.waiting_for_blocks = 0  # ready sequences the last dispatch held back for want of free blocks

    def observe(self, batch, role: str) -> None:
        """Keeps the KV usage a worker's batch (VerdictBatch: "target", DraftChunkBatch: "draft") reports."""
        if batch.HasField("kv"):
            if role == "target":
                self.target_kv = batch.kv
            else:
                self.draft_kv = batch.kv

    @staticmethod
    def preempted(live: Iterable) -> list:
        """The `live` sequences waiting to resume, oldest preemption first."""
        return sorted((s for s in live if s.preempted_at is not None), key=lambda s: s.preempted_at)

    @staticmethod
    def victim(live: Iterable):
        """Which running sequence gives its blocks back after a batch the target's pool could not hold:
        one per batch, since the target fitted as many items as it could, so one sequence's blocks are
        what the next round most likely needs (if not, it answers KV_CACHE_FULL again). None when
        nothing else holds blocks it could give back."""
        running = [s for s in live if s.finish_reason is None and s.preempted_at is None]
        if len(running) <= 1:
            return None
        return min(running, key=lambda s: (s.request.priority_weight, -s.seq_id))

    def admit(self, ready: list, live: Iterable) -> list:
        """Admission by free blocks (vLLM's): of the `ready` sequences, those the target has not started
        (a new prompt, or a preempted sequence's recompute) go only while the target's last-reported
        free blocks hold their tokens and a block to decode into, oldest first; the rest wait,
        counted in `waiting_for_blocks`. So a full pool turns new prompts away instead of taking them
        in and preempting running sequences for them. When no other sequence holds the target's
        blocks the oldest goes anyway (the pool holds one request of max_model_len: checked at load).
        Before the target's first report every sequence goes."""
        kv = self.target_kv
        starting = sorted((s for s in ready if s.target_len == 0), key=lambda s: s.started_at)
        if kv is None or not kv.block_size or not starting:
            self.waiting_for_blocks = 0
            return ready
        free = kv.free_blocks
        others_hold = any(s.target_len > 0 and s.finish_reason is None for s in live)
        admitted = []
        for seq in starting:
            need = -(-len(seq.committed) // kv.block_size) + 1
            if need <= free or not (others_hold or admitted):
                admitted.append(seq)
                free -= need
        self.waiting_for_blocks = len(starting) - len(admitted)
        return [s for s in ready if s.target_len > 0 or any(s is a for a in admitted)]

    def preempt(self, seq, drafter: Drafter) -> None:
        """Frees `seq`'s blocks on the drafter; the caller has the target release it with its next batch."""
        self.num_preemptions += 1
        seq.preempted_at = time.monotonic()
        seq.forget_verify()
        seq.target_len = 0  # the target re-prefills it on resume
        if seq.draft_started and seq.draft_alive and drafter.up:
            drafter.free(seq)
        seq.draft_started = False
        seq.start_new_epoch()  # anything the drafter sent before the RELEASE is stale
        seq.draft_fed_len = 0

    def resume(self, live: Iterable, drafter: Drafter) -> None:
        """A sequence ended and gave its blocks back: the oldest preempted sequence runs again."""
        waiting = self.preempted(live)
        if not waiting:
            return
        seq = waiting[0]
        seq.preempted_at = None
        if seq.uses_draft and drafter.up:
            drafter.start(seq)


def kv_full_error() -> Overloaded:
    """What a sequence gets that the target's KV cache cannot hold even alone."""
    return Overloaded("the target's KV cache cannot hold this sequence even alone; give "
                      "the model more KV memory (models[].kv_cache_memory_bytes)")
