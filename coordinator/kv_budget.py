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
    """What preemption asks of the drafter's channel (coordinator/draft_commands.py DraftChannel)."""

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
