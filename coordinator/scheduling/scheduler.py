"""The PEARL scheduler: one loop for every live sequence and every mode (docs/design.md#the-pearl-protocol).

    drafter ──DraftChunkBatch──▶ on_draft_batch ─┐
                                                 ├─▶ _dispatch ──VerifyBatch──▶ target
    target ──VerdictBatch──▶ on_verdict_batch ───┘        (at most one batch in flight)
                 │
                 └─▶ commit, stream TokensEvent, ADVANCE / RESET (abort + rollback) ──▶ drafter

Everything runs on one asyncio loop, so sequence state needs no locks. The target is kept busy:
whenever a verdict batch comes back, the next batch goes out with whatever drafts have arrived (one
token is enough in pearl: that is pre-verify; for a greedy request right after a rejection even none,
an empty round), while the drafter keeps drafting past the chunk under verification (post-verify).
A rejection bumps the sequence's epoch; chunks and verdicts with an old epoch are dropped. The mode
only changes the policy object (coordinator/scheduling/policies.py). How much to speculate:
coordinator/scheduling/adaptive.py (draft length), patience.py (waiting for a fuller chunk), guard.py
(speculating at all). The scheduler holds its collaborators, each owning its own state:
    drafter     DraftChannel (draft_commands.py): the drafter's link, up or not, the commands queued
    batches     VerifyBatchBuilder (verify_items.py): chosen sequences, budget -> items, deferred
    supervisor  WorkerSupervisor (recovery.py): both links, the target up or not, readers,
                watchdogs and reconnection when a worker's stream breaks, stalls or hangs
    kv          KVPreemption (kv_budget.py): preemption when the target's KV pool runs out
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass

from duospec.coordinator.scheduling.adaptive import (AcceptanceTracker, Ewma, VerifyCostModel, best_draft_length,
                                          drafts_worth_waiting_for, wait_for_drafts_s)
from duospec.coordinator.api import (CoordinatorError, FinishEvent, FinishReason, GenerationRequest, ModelInfo,
                                     TokenLogprob, TokensEvent, Unavailable)
from duospec.coordinator.scheduling.draft_commands import DraftChannel
from duospec.coordinator.scheduling.guard import GoodputGuard
from duospec.coordinator.scheduling.kv_budget import KVPreemption, kv_full_error
from duospec.coordinator.scheduling.links import Link, Reconnect, verify_error
from duospec.coordinator.scheduling.rounds import InFlightVerify, SchedulerConfig, WorkerTimes
from duospec.coordinator.scheduling.patience import Patience
from duospec.coordinator.scheduling.recovery import WorkerSupervisor, waits_for_drafter
from duospec.coordinator.scheduling.verify_items import VerifyBatchBuilder, fed_to, item_rows
from duospec.coordinator.scheduling.policies import SpeculationPolicy, fair_share
from duospec.coordinator.scheduling.sequence import Sequence
from duospec.internal.constraint_wire import add_grammar_work
from duospec.internal.kv_wire import kv_usage_report
from duospec.internal.v1 import pearl_pb2 as pb

log = logging.getLogger(__name__)

LOOKUP_PROBE_EVERY = 16  # while looked-up tokens do not pay, every 16th empty round still verifies one
ACCEPTANCE_FLOOR = 0.5  # the lowest acceptance a new (or re-tried) sequence's estimate starts from


@dataclass
class _Failure:
    error: CoordinatorError


class Scheduler:
    def __init__(self, info: ModelInfo, target: Link, draft: Link | None, config: SchedulerConfig, *,
                 reconnect_target: Reconnect | None = None, reconnect_draft: Reconnect | None = None):
        self.info = info
        self.config = config
        self.sequences: dict[int, Sequence] = {}
        self.inflight: InFlightVerify | None = None
        self.target_times = WorkerTimes()
        self.draft_times = WorkerTimes()
        # The coordinator's own time per verdict: applying it and sending the next batch. The rest of
        # a round beside the target's forward is the links' (serialisation, transport, wake-ups).
        self.verdict_handling_s = 0.0
        self._seq_ids = itertools.count(1)
        self._batch_ids = itertools.count(1)
        self._target_releases: list[int] = []
        self._vtime: dict[str, float] = {}  # weighted fair share: target rows / weight per tenant (_charge)
        self._slots = asyncio.Semaphore(config.max_num_seqs)
        self._idle_since = time.monotonic()
        self._deferring = False  # True while a batch is being applied: dispatch once, at its end
        # Adaptive draft length for pearl sequences (coordinator/scheduling/adaptive.py).
        self.verify_cost = VerifyCostModel()
        self.pearl_draft_length: int | None = None  # None: not measured yet, use each policy's max
        self.guard = GoodputGuard()  # speculate only while it beats the target alone (coordinator/scheduling/guard.py)
        # Acceptance of this model's drafts lately: a new sequence's prior (floored, _acceptance_prior),
        # so a good drafter speculates fully from a request's first round.
        self.recent_acceptance = Ewma(decay=0.95)
        # Per-token acceptance of the empty rounds' looked-up tokens (coordinator/scheduling/lookup.py), all sequences
        self.lookup_acceptance = AcceptanceTracker(decay=0.95)
        self._lookup_probe = 0  # counts the empty rounds sent without a lookup (LOOKUP_PROBE_EVERY)
        self.patience = Patience(wake=self._dispatch)
        self.drafter = DraftChannel(draft, info.prefix_cache, info.draft_method)
        self.batches = VerifyBatchBuilder(info.max_context, info.prefix_cache, draft_limit=self._draft_limit,
                                          lookup_length=self._lookup_length,
                                          may_verify_without_drafts=self._may_verify_without_drafts)
        self.supervisor = WorkerSupervisor(target, self.drafter, self, hang_timeout_s=config.hang_timeout_s,
                                           patience=self.patience, verify_cost=self.verify_cost,
                                           reconnect_target=reconnect_target, reconnect_draft=reconnect_draft)
        self.kv = KVPreemption()

    async def start(self) -> None:
        self.supervisor.start()

    async def close(self) -> None:
        self.supervisor.stop()
        self.patience.end()
        for seq in list(self.sequences.values()):
            self._finish(seq, FinishReason.CANCELLED)
        await self.supervisor.close_links()

    @property
    def closed(self) -> bool:
        return self.supervisor.closed

    @property
    def target_serving(self) -> bool:
        """Whether the target is connected: the server's health is SERVING only while it is."""
        return self.supervisor.target_serving

    @property
    def workers(self) -> tuple[Link, Link | None]:
        """The links to the target and the drafter (None: no drafter) as they are now."""
        return self.supervisor.target, self.drafter.link

    # -- public entry --------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest, policy: SpeculationPolicy):
        """Async generator of TokensEvent..., FinishEvent. Closing it early cancels the sequence."""
        if self.closed:
            raise Unavailable("the coordinator is shutting down; retry on another replica")
        if not self.target_serving:
            raise Unavailable("the target worker is down or restarting; retry in a few seconds")
        await self._slots.acquire()
        seq = None
        try:
            if not self.target_serving:  # changed while this request waited for a slot
                raise Unavailable("the coordinator is shutting down or its target is down; retry later")
            seq = self._add(request, policy)
            while True:
                event = await seq.events.get()
                if isinstance(event, _Failure):
                    raise event.error
                yield event
                if isinstance(event, FinishEvent):
                    return
        finally:
            if seq is not None and seq.finish_reason is None:
                self._finish(seq, FinishReason.CANCELLED, notify=False)
            self._slots.release()

    def _add(self, request: GenerationRequest, policy: SpeculationPolicy) -> Sequence:
        use_draft = policy.uses_draft and self.drafter.up
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request=request,
            policy=policy,
            committed=list(request.prompt_token_ids),
            eos_token_ids=self.info.end_token_ids,
            draft_alive=use_draft,
            needs_features=use_draft and self.drafter.reads_features,
        )
        seq.acceptance = self._acceptance_prior()
        # A tenant (re)joining starts at the least-served active tenant's virtual time: no catch-up burst.
        others = [self._vtime.get(s.request.tenant, 0.0) for s in self.sequences.values()]
        self._vtime[request.tenant] = max(self._vtime.get(request.tenant, 0.0), min(others, default=0.0))
        if self._guarded(seq) and not any(self._guarded(s) for s in self.sequences.values()):
            self.guard.work_arrived()
        if use_draft:
            # Target-only by the guard: the drafter holds the sequence but neither prefills nor drafts
            # until speculation resumes (then a RESET feeds it everything).
            seq.draft_paused = self._draft_limit(seq) == 0
            self.drafter.start(seq)
        self.sequences[seq.seq_id] = seq
        self._dispatch()
        return seq

    # -- drafts in -----------------------------------------------------------------------------
    def on_draft_batch(self, batch: pb.DraftChunkBatch) -> None:
        heard_at = self.supervisor.heard_from_drafter()
        longest = max((len(c.tokens) for c in batch.chunks), default=0)
        if longest and batch.busy_seconds > 0:  # merged messages carry several steps per chunk
            self.patience.draft_step_s.observe(batch.busy_seconds / longest)
        self.draft_times.busy_s += batch.busy_seconds
        self.draft_times.idle_s += batch.idle_seconds
        if batch.HasField("grammar"):
            add_grammar_work(self.draft_times.grammar, batch.grammar)
        self.draft_times.messages += 1
        self.kv.observe(batch, "draft")
        self._deferring = True
        try:
            self._apply_draft_chunks(batch, heard_at)
        finally:
            self._deferring = False
        self._dispatch()

    def _apply_draft_chunks(self, batch: pb.DraftChunkBatch, heard_at: float) -> None:
        for seq_id in batch.failed_seq_ids:
            seq = self.sequences.get(seq_id)
            if seq is not None:
                seq.drop_drafts()
                seq.draft_alive = False
        for chunk in batch.chunks:
            seq = self.sequences.get(chunk.seq_id)
            if seq is None or not seq.draft_alive:
                continue
            if chunk.HasField("hedge"):  # for the speculation cache; never a reason to resync
                if chunk.epoch == seq.epoch and not seq.draft_paused:
                    seq.add_hedge(chunk.hedge.pos, chunk.hedge.token, chunk.start_pos, chunk.tokens, chunk.draft_probs)
                continue
            if chunk.tokens and (restarted_at := seq.spec.first_draft(chunk.epoch)) is not None:
                # timed even when the epoch has moved on since: a slow restart must not go unmeasured
                self.patience.first_draft_s.observe(heard_at - restarted_at)
            if chunk.epoch != seq.epoch or seq.draft_paused:  # an aborted branch, or drafted before a pause
                seq.stats.wasted_draft_tokens += len(chunk.tokens)
                continue
            decided = seq.decided_prefix(chunk.start_pos, chunk.tokens)
            if decided is None:  # it guessed a token an empty round decided otherwise: start it over
                seq.stats.wasted_draft_tokens += len(chunk.tokens)
                self.drafter.abort(seq)
                continue
            seq.drafter_holds(chunk.start_pos, decided)
            start = chunk.start_pos + decided
            exhausted = chunk.outlook == pb.DRAFT_OUTLOOK_EXHAUSTED
            if start < len(seq.committed):  # all of it at decided positions, and as drafted
                if exhausted:  # the drafter waits for a command, not knowing those tokens: a RESET has them
                    self.drafter.abort(seq)
                else:
                    seq.draft_fed_len = max(seq.draft_fed_len, start - 1)
                continue
            if not seq.add_drafts(start, chunk.tokens[decided:], chunk.draft_probs[decided:], exhausted,
                                  chunk.alternatives[decided:], forced=chunk.forced):
                log.warning("seq %d: draft chunk at %d, expected %d; resyncing", seq.seq_id, chunk.start_pos,
                            seq.next_draft_pos)
                seq.stats.wasted_draft_tokens += len(chunk.tokens) + len(seq.drafts)
                self.drafter.abort(seq)

    # -- verify out ----------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Ends every event: sends the drafter its commands, then the target a batch if it is free."""
        if self._deferring:
            return
        self.drafter.flush()
        if self.inflight is not None or self.closed or not self.supervisor.target_up:
            return
        ready = self.kv.admit([s for s in self.sequences.values() if s.finish_reason is None and self._ready(s)],
                              self.sequences.values())
        if not ready and not self._target_releases:
            self.patience.end()  # nothing is waiting for the target (e.g. the held sequence was aborted)
            return
        waits: dict[int, float] = {}  # seq_id -> _wait_for_drafts_s, each worked out once per dispatch

        def wait_s(seq: Sequence) -> float:
            if seq.seq_id not in waits:
                waits[seq.seq_id] = self._wait_for_drafts_s(seq)
            return waits[seq.seq_id]

        if not self._target_releases and self.patience.hold(wait_s(s) for s in ready):
            return
        if not self.patience.expired:  # not held because another sequence goes now: an empty one that
            # would rather wait for its drafts still does, unless the hold ran out
            ready = [s for s in ready if not self._may_verify_without_drafts(s) or wait_s(s) == 0]
        self.patience.end()
        chosen = fair_share(ready, self._vtime, self.config.max_batch_size)
        items, deferred = self.batches.build(chosen, self.config.prefill_chunk_tokens)
        if deferred:  # their prefill waits for the next round
            chosen = [s for s in chosen if all(s is not d for d in deferred)]
        self._charge(chosen, items)
        batch = pb.VerifyBatch(batch_id=next(self._batch_ids), items=items, release_seq_ids=self._target_releases)
        self._target_releases = []
        now = time.monotonic()
        self.target_times.idle_s += now - self._idle_since
        n_tokens = sum(item_rows(item) for item in items)
        decode_only = all(len(item.context) == 1 for item in items)
        self.inflight = InFlightVerify(batch.batch_id, [s.seq_id for s in chosen], now, n_tokens, decode_only)
        self.supervisor.target.send(batch)

    def _charge(self, chosen: list[Sequence], items: list[pb.VerifyItem]) -> None:
        """Fair share counts what each item costs the target: its rows (context and draft tokens, tree
        branches included), not the tokens it commits, so a tenant whose long drafts are mostly
        rejected pays for them instead of the other tenants in the batch."""
        for seq, item in zip(chosen, items):
            tenant = seq.request.tenant
            rows = item_rows(item)
            self._vtime[tenant] = self._vtime.get(tenant, 0.0) + rows / seq.request.priority_weight

    def _draft_limit(self, seq: Sequence) -> int:
        """Most drafts to verify for `seq` now: the policy's cap, lowered by the adaptive length in pearl.
        Sampling keeps k >= 1: a timing-dependent switch to the bonus rule would change seeded output."""
        return seq.policy.draft_limit(seq.greedy, self.guard.speculating, self.pearl_draft_length)

    def _acceptance_prior(self) -> AcceptanceTracker:
        """Where a sequence's acceptance estimate starts: the model's recent acceptance, but never
        below ACCEPTANCE_FLOOR — a drafter written off once must still get tried again."""
        recent = self.recent_acceptance.value
        return AcceptanceTracker.with_prior(max(recent if recent is not None else 1.0, ACCEPTANCE_FLOOR))

    @staticmethod
    def _guarded(seq: Sequence) -> bool:
        """Whether the goodput guard may switch this sequence's speculation off (greedy adaptive pearl;
        coordinator/scheduling/guard.py says why sampled requests are not)."""
        return seq.policy.guarded(seq.greedy)

    def _lookup_length(self, seq: Sequence) -> int:
        """Most looked-up tokens an empty round verifies: what pays by the verify cost model and the
        lookups' measured acceptance for a batch of the live sequences (more rows in a fuller batch
        cost more against what it commits anyway), within the request's draft cap and length limit."""
        max_k = min(seq.policy.max_draft_tokens, seq.remaining - 1)
        if max_k <= 0:
            return 0
        batch = min(len(self.sequences), self.config.max_batch_size)
        k = best_draft_length([self.lookup_acceptance.alpha] * max(1, batch), self.verify_cost, max_k)
        if k == 0:  # not paying lately: still try one token now and then, or a text that turns
            self._lookup_probe = (self._lookup_probe + 1) % LOOKUP_PROBE_EVERY  # repetitive goes unseen
            k = int(self._lookup_probe == 0)
        return k

    def _ready(self, seq: Sequence) -> bool:
        if seq.preempted_at is not None:
            return False
        if seq.uses_draft and (seq.draft_paused or seq.draft_exhausted or self._draft_limit(seq) == 0):
            return True  # backed off to target-only under load, or the drafter has nothing more for now
        if seq.needs_features and seq.prefill_pending and not seq.drafts:
            return True  # a head drafts from the prompt's hidden states: the target reads it first
        if self._may_verify_without_drafts(seq):
            return True  # patience decides whether the target waits for the first draft
        return seq.policy.ready(len(seq.drafts), seq.remaining, seq.uses_draft, seq.prefill_pending,
                                free=seq.free_drafts)

    def _may_verify_without_drafts(self, seq: Sequence) -> bool:
        """Whether a sequence with no draft (right after a rejection) may go to a free target, whose
        bonus token is then its next token, instead of the target idling until the restarted drafter
        delivers a first draft. What the drafter drafts meanwhile is not lost: its chunk continues the
        sequence when its first tokens are the ones the target decided (Sequence.apply_verdict keeps
        the epoch, Sequence.decided_prefix checks the chunk, during the round or after it). Greedy
        adaptive pearl only: a sampled pearl request declines the bonus (its positions must be decided
        by one rule whatever the timing), vanilla is the fixed baseline, and an exhausted drafter has
        nothing coming (its round takes the bonus and restarts it, as before). A head drafter may go
        too: the rejecting verdict's hidden states reach it with the RESET, so EAGLE drafts from them
        while the empty round runs, and the hidden state that round computes replaces the head's own
        prediction for that position when it arrives (draft_worker/eagle_proposer.py re-feeds; Medusa
        proposes from it). Patience weighs the wait (drafts_worth_waiting_for) once the restart time
        has been measured; in a batch that goes anyway, such a sequence rides
        along empty only if that is its own best choice (_dispatch)."""
        return (not seq.drafts and not seq.draft_exhausted and seq.uses_draft and self._guarded(seq)
                and self.patience.first_draft_s.value is not None)

    def _wait_for_drafts_s(self, seq: Sequence) -> float:
        """Pearl patience (coordinator/scheduling/patience.py): the expected seconds until the drafts worth waiting
        for before verifying are there (0: go now)."""
        if not (seq.uses_draft and seq.policy.adaptive_pearl) or (
                seq.draft_paused or seq.draft_exhausted or seq.prefill_pending):
            return 0.0
        free = seq.free_drafts  # grammar-forced drafts go along free: waiting is for the drafter's own
        n = len(seq.drafts) - free
        # (The drafter's lookahead always reaches past the draft limit: policies.lookahead > γ.)
        reachable = min(self._draft_limit(seq), seq.remaining - free)
        step, first = self.patience.draft_step_s.value or 0.0, self.patience.first_draft_s.value
        k = drafts_worth_waiting_for(seq.acceptance.alpha, n, reachable, self.verify_cost, step,
                                     self.patience.round_overhead_s.value or 0.0, len(seq.committed) - seq.target_len,
                                     first)
        return wait_for_drafts_s(k, n, step, first)

    def _adapt_draft_length(self) -> None:
        pearl = [
            s
            for s in self.sequences.values()
            if s.uses_draft and s.policy.adaptive_pearl
        ]
        if not pearl:
            return
        max_k = max(s.policy.max_draft_tokens for s in pearl)
        batch = pearl[: self.config.max_batch_size]
        self.pearl_draft_length = best_draft_length([s.acceptance.alpha for s in batch], self.verify_cost, max_k)
        for seq in pearl:  # speculation pays again: wake paused drafters now, not at their next verdict
            if seq.draft_paused and not seq.verifying and self._draft_limit(seq) > 0:
                seq.draft_paused = False
                self.drafter.abort(seq)

    # -- verdicts in ---------------------------------------------------------------------------
    def on_verdict_batch(self, batch: pb.VerdictBatch) -> None:
        handling_from = time.perf_counter()
        try:
            self._apply_verdict_batch(batch)
        finally:
            self.verdict_handling_s += time.perf_counter() - handling_from

    def _apply_verdict_batch(self, batch: pb.VerdictBatch) -> None:
        inflight = self.inflight
        if inflight is None or batch.batch_id != inflight.batch_id:
            log.warning("verdict batch %d was not expected; ignored", batch.batch_id)
            return
        self.inflight = None
        self.target_times.busy_s += batch.forward_seconds
        self.target_times.messages += 1
        if batch.HasField("grammar"):
            add_grammar_work(self.target_times.grammar, batch.grammar)
        self.kv.observe(batch, "target")
        self._idle_since = time.monotonic()
        if batch.verdicts and inflight.decode_only:
            self.verify_cost.observe(inflight.n_tokens, batch.forward_seconds)
            self.target_times.decode_batches += 1
            self.target_times.decode_rows += inflight.n_tokens
            self.patience.round_overhead_s.observe(max(0.0, self._idle_since - inflight.sent_at - batch.forward_seconds))
        self._deferring = True
        try:
            kv_full = []
            for error in batch.errors:
                seq = self.sequences.get(error.seq_id)
                if seq is not None and error.kind == pb.VERIFY_ERROR_KIND_KV_CACHE_FULL:
                    kv_full.append(seq)
                elif seq is not None:
                    self._fail(seq, verify_error(error))
            answered = {v.seq_id for v in batch.verdicts} | {e.seq_id for e in batch.errors}
            guarded = [s for s in self.sequences.values() if self._guarded(s)]
            drafted = any(s.verify_tokens for s in guarded)
            committed_guarded = 0
            for verdict in batch.verdicts:
                seq = self.sequences.get(verdict.seq_id)
                if seq is None or seq.finish_reason is not None:
                    continue
                if verdict.epoch != seq.epoch:  # aborted while it was being verified
                    seq.forget_verify()
                    continue
                kept = self._apply_verdict(seq, verdict)
                committed_guarded += kept if self._guarded(seq) else 0
            if guarded:
                was_speculating = self.guard.speculating
                self.guard.observe_round(committed_guarded, len(guarded), drafted, inflight.decode_only)
                if self.guard.speculating and not was_speculating:  # a probe or a switch back: really try
                    for seq in guarded:
                        seq.acceptance = self._acceptance_prior()
            for seq_id in set(inflight.seq_ids) - answered:
                if (seq := self.sequences.get(seq_id)) is not None:
                    seq.forget_verify()
            self._on_kv_full(kv_full)  # after the verdicts: a sequence preempted now has its own applied
            self._adapt_draft_length()
        except Exception:  # a bug here must not look like a lost target: fail this batch's sequences
            log.exception("applying verdict batch %d failed", batch.batch_id)
            for seq_id in inflight.seq_ids:
                if (seq := self.sequences.get(seq_id)) is not None and seq.finish_reason is None:
                    self._fail(seq, CoordinatorError("internal error applying a verdict; see the server log"))
        finally:
            self._deferring = False
        self._dispatch()

    def _apply_verdict(self, seq: Sequence, verdict: pb.Verdict) -> int:
        """Commits a verdict and tells the drafter what it needs; returns the tokens committed."""
        if seq.needs_features and seq.draft_started and seq.draft_alive:
            self.drafter.forward_features(seq, verdict)
        if len(seq.committed) == seq.prompt_len:  # the prompt's first prefill (not a recompute's)
            seq.stats.cached_prompt_tokens += verdict.cached_tokens
        fed_to(seq, verdict)
        next_token = verdict.next_token if verdict.kind != pb.NEXT_TOKEN_KIND_NONE else None
        outcome = seq.apply_verdict(verdict.n_accepted, next_token, verdict.kind == pb.NEXT_TOKEN_KIND_RECOVERED,
                                    verdict.path)
        if outcome.looked_up:
            self.lookup_acceptance.observe(min(verdict.n_accepted, outcome.looked_up),
                                           int(verdict.n_accepted < outcome.looked_up))
        if outcome.drafted:
            self.recent_acceptance.observe(seq.acceptance.alpha)
        if outcome.kept:
            logprobs = tuple(TokenLogprob(t, lp.logprob, tuple(zip(lp.top_ids, lp.top_logprobs)))
                             for t, lp in zip(outcome.kept, verdict.logprobs))
            seq.events.put_nowait(TokensEvent(outcome.kept, seq.stats, logprobs))
        if seq.finish_reason is None and verdict.grammar_dead_end:  # its constraint allows nothing more
            seq.finish_reason = FinishReason.GRAMMAR_DEAD_END
        if seq.finish_reason is not None:
            self._finish(seq, seq.finish_reason)
        else:
            self.drafter.after_verdict(seq, outcome, backed_off=self._draft_limit(seq) == 0)
        return len(outcome.kept)

    # -- endings -------------------------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        self.sequences.pop(seq.seq_id, None)
        self._target_releases.append(seq.seq_id)
        if seq.draft_started and seq.draft_alive and self.drafter.up:
            self.drafter.release(seq)
        seq.drop_drafts()
        if not self.closed:  # a sequence ended and gave its blocks back
            self.kv.resume(self.sequences.values(), self.drafter)
        if not self.closed:
            self._dispatch()

    def _finish(self, seq: Sequence, reason: FinishReason, notify: bool = True) -> None:
        seq.finish_reason = reason
        self._release(seq)
        if notify:
            seq.events.put_nowait(
                FinishEvent(
                    finish_reason=reason,
                    prompt_tokens=seq.prompt_len,
                    completion_tokens=len(seq.committed) - seq.prompt_len,
                    stats=seq.stats,
                )
            )

    def _fail(self, seq: Sequence, error: CoordinatorError) -> None:
        seq.finish_reason = FinishReason.CANCELLED
        self._release(seq)
        seq.events.put_nowait(_Failure(error))

    def _on_kv_full(self, seqs: list[Sequence]) -> None:
        """`seqs`: this verdict batch's sequences the target's pool could not hold (KVPreemption)."""
        for seq in seqs:
            seq.forget_verify()
        if not seqs:
            return
        victim = self.kv.victim(self.sequences.values())
        if victim is None:  # nothing else holds blocks it could give back
            for seq in seqs:
                self._fail(seq, kv_full_error())
            return
        self.kv.preempt(victim, self.drafter)
        self._target_releases.append(victim.seq_id)

    # -- the workers' ups and downs (WorkerSupervisor, coordinator/scheduling/recovery.py) ------------------
    def on_draft_lost(self) -> None:
        for seq in self.sequences.values():
            if seq.draft_alive:
                seq.drop_drafts()
                seq.draft_alive = False
        if not self.closed:
            self._dispatch()

    def on_target_down(self) -> None:
        self.inflight = None
        self._target_releases = []  # the restarted target holds no sequences
        for seq in self.sequences.values():
            seq.target_len = 0  # the next verify re-sends all committed tokens: a re-prefill
            seq.forget_verify()

    def on_target_back(self) -> None:
        log.info("target reconnected; re-prefilling %d live sequences", len(self.sequences))
        self._dispatch()

    def on_target_lost(self) -> None:
        self.inflight = None
        for seq in list(self.sequences.values()):
            self._fail(seq, Unavailable("the target worker is unavailable and did not restart in time; retry later"))

    def waiting_for_drafts(self) -> bool:
        """Whether a live sequence waits for the drafter's next chunk (the drafter's stall watchdog)."""
        # in the batch the target works on, with drafts: an empty round's sequence still waits for them
        busy = {i for i in self.inflight.seq_ids if (s := self.sequences.get(i)) is not None and s.verify_tokens} \
            if self.inflight is not None else set()
        return any(waits_for_drafter(seq, seq.seq_id in busy) for seq in self.sequences.values())

    def verify_in_flight(self) -> InFlightVerify | None:
        return self.inflight

    def stats(self) -> dict:
        return {
            "live_sequences": len(self.sequences),
            "preempted_sequences": len(self.kv.preempted(self.sequences.values())),
            "waiting_for_blocks": self.kv.waiting_for_blocks,  # not started: the target's pool is full
            "num_preemptions": self.kv.num_preemptions,
            "verify_in_flight": self.inflight is not None,
            "target": {
                "busy_s": self.target_times.busy_s,
                "idle_s": self.target_times.idle_s,
                "batches": self.target_times.messages,
                "decode_batches": self.target_times.decode_batches,
                "decode_rows": self.target_times.decode_rows,
                "connected": self.supervisor.target_up,
                "restarts": self.supervisor.target_restarts,
                "verify_cost_s": dict(zip(("fixed", "per_token"), self.verify_cost.coefficients())),
                "verdict_handling_s": self.verdict_handling_s,
                **kv_usage_report(self.kv.target_kv),
                **self.target_times.grammar_report(),
            },
            "pearl_draft_length": self.pearl_draft_length,
            "guard": self.guard.stats(),
            "patience": {"holds": self.patience.holds, "draft_step_s": self.patience.draft_step_s.value,
                         "round_overhead_s": self.patience.round_overhead_s.value,
                         "first_draft_s": self.patience.first_draft_s.value},
            "draft": {
                "busy_s": self.draft_times.busy_s,
                "idle_s": self.draft_times.idle_s,
                "batches": self.draft_times.messages,
                "connected": self.drafter.up,
                "restarts": self.supervisor.draft_restarts,
                **kv_usage_report(self.kv.draft_kv),
                **self.draft_times.grammar_report(),
            },
        }

