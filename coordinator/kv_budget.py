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

from duospec.coordinator.api import Overloaded
from duospec.internal.v1 import pearl_pb2 as pb

PREFIX_CACHE_SCOPES = ("tenant", "shared", "off")


def cache_salt(scope: str, tenant: str) -> str:
    """The salt of a request's cached blocks under `scope`."""
    return f"tenant:{tenant}" if scope == "tenant" else ""


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

    Mixed into `Scheduler` (coordinator/scheduler.py), whose state these methods read and write:
    `sequences`, `_target_releases`, `_draft_up`, `_draft_command`, `_start_draft`, `_fail`.
    """

    num_preemptions = 0
    # the workers' KV pools as their latest batches reported them (pearl.proto KVUsage; None: not yet)
    target_kv = None
    draft_kv = None

    @property
    def preempted(self) -> list:
        """Sequences waiting to resume, oldest preemption first."""
        return sorted((s for s in self.sequences.values() if s.preempted_at is not None), key=lambda s: s.preempted_at)

    def _on_kv_full(self, seqs: list) -> None:
        """`seqs`: this verdict batch's sequences the target's pool could not hold. One sequence is
        preempted per batch: the target fitted as many items as it could, so one sequence's blocks
        are what the next round most likely needs (if not, it answers KV_CACHE_FULL again)."""
        for seq in seqs:
            seq.forget_verify()
        if not seqs:
            return
        running = [s for s in self.sequences.values() if s.finish_reason is None and s.preempted_at is None]
        if len(running) <= 1:  # nothing else holds blocks it could give back
            for seq in seqs:
                self._fail(seq, Overloaded("the target's KV cache cannot hold this sequence even alone; give "
                                           "the model more KV memory (models[].kv_cache_memory_bytes)"))
            return
        self._preempt(min(running, key=lambda s: (s.request.priority_weight, -s.seq_id)))

    def _preempt(self, seq) -> None:
        self.num_preemptions += 1
        seq.preempted_at = time.monotonic()
        seq.forget_verify()
        self._target_releases.append(seq.seq_id)
        seq.target_len = 0  # the target re-prefills it on resume
        if seq.draft_started and seq.draft_alive and self._draft_up:
            self._draft_command(pb.DraftCommand(seq_id=seq.seq_id, kind=pb.DRAFT_COMMAND_KIND_RELEASE))
        seq.draft_started = False
        seq.start_new_epoch()  # anything the drafter sent before the RELEASE is stale
        seq.draft_fed_len = 0

    def _resume_preempted(self) -> None:
        """A sequence ended and gave its blocks back: the oldest preempted sequence runs again."""
        waiting = self.preempted
        if not waiting or self.closed:
            return
        seq = waiting[0]
        seq.preempted_at = None
        if seq.uses_draft and self._draft_up:
            self._start_draft(seq)
