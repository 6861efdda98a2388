"""The scheduler's bookkeeping with fake links: exact scenarios, no models, no threads.

Each test drives `Scheduler` the way the links would (draft chunk batches in, verdict batches in) and
checks what it commits and what it tells the workers.
"""

from __future__ import annotations

import asyncio

import pytest

from duospec.coordinator.api import GenerationRequest, ModelInfo, SpeculationMode, TokensEvent, Unavailable
from duospec.coordinator.scheduling.policies import SpeculationPolicy
from duospec.coordinator.scheduling.scheduler import Scheduler, SchedulerConfig
from duospec.internal.v1 import pearl_pb2 as pb
from duospec.sampling import SamplingParams


class FakeLink:
    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)

    async def responses(self):
        return
        yield

    async def close(self):
        pass


def _scheduler(mode=SpeculationMode.PEARL, draft_method=None, **config):
    info = ModelInfo(name="m", target_path="t", draft_path="d", vocab_size=100, max_context=256, eos_token_id=None,
                     draft_method=draft_method)
    target, draft = FakeLink(), FakeLink()
    scheduler = Scheduler(info, target, draft, SchedulerConfig(**config))
    policy = SpeculationPolicy(mode=mode, max_draft_tokens=4, max_lookahead=8, adaptive=False)
    return scheduler, target, draft, policy


def _request(prompt=(1, 2, 3), n=10, tenant="default", weight=1.0, sampling=SamplingParams()):
    return GenerationRequest(
        request_id=f"r-{tenant}", prompt_token_ids=tuple(prompt), max_new_tokens=n, sampling=sampling,
        tenant=tenant, priority_weight=weight,
    )


def _chunks(scheduler, seq, pos, tokens):
    scheduler.on_draft_batch(
        pb.DraftChunkBatch(chunks=[pb.DraftChunk(seq_id=seq.seq_id, epoch=seq.epoch, start_pos=pos, tokens=tokens)])
    )


def _verdict(scheduler, target, seq, n_accepted, kind, next_token=0):
    batch = target.sent[-1]
    scheduler.on_verdict_batch(
        pb.VerdictBatch(
            batch_id=batch.batch_id,
            verdicts=[pb.Verdict(seq_id=seq.seq_id, epoch=seq.epoch, n_accepted=n_accepted, kind=kind, next_token=next_token)],
        )
    )


def _committed_events(seq):
    out = []
    while not seq.events.empty():
        event = seq.events.get_nowait()
        if isinstance(event, TokensEvent):
            out.extend(event.token_ids)
    return out


async def test_accepted_drafts_survive_a_draft_failure_during_verify():
    scheduler, target, draft, policy = _scheduler()
    seq = scheduler._add(_request(), policy)
    _chunks(scheduler, seq, 3, [10])  # pre-verify goes out with one token... (after the prompt prefill)
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_NONE)  # prefill-only verdict
    for pos, tok in ((4, 11), (5, 12)):
        _chunks(scheduler, seq, pos, [tok])
    sent = target.sent[-1].items[0]
    assert list(sent.draft_tokens) == [10]
    scheduler.on_draft_batch(pb.DraftChunkBatch(failed_seq_ids=[seq.seq_id]))  # drafter drops it
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_BONUS, 99)
    assert seq.committed == [1, 2, 3, 10, 99]
    assert _committed_events(seq) == [10, 99]
    assert seq.target_len == 4


async def test_the_coordinator_times_its_own_handling_of_each_verdict():
    # (the bench's overhead split: the coordinator's handling vs the links' transport and wake-ups)
    scheduler, target, draft, policy = _scheduler()
    seq = scheduler._add(_request(), policy)
    _chunks(scheduler, seq, 3, [10])
    handled = [scheduler.stats()["target"]["verdict_handling_s"]]
    for kind, token in ((pb.NEXT_TOKEN_KIND_NONE, 0), (pb.NEXT_TOKEN_KIND_BONUS, 99)):
        _chunks(scheduler, seq, len(seq.committed) + len(seq.drafts), [11])
        _verdict(scheduler, target, seq, 0 if kind == pb.NEXT_TOKEN_KIND_NONE else 1, kind, token)
        handled.append(scheduler.stats()["target"]["verdict_handling_s"])
    assert handled[0] == 0.0 and handled[0] < handled[1] < handled[2]
    target_stats = scheduler.stats()["target"]
    assert target_stats["batches"] == 2
    # rows per decode batch (benchmarks/structured.py): the prompt's batch is not one of them
    [decode] = [b.items[0] for b in target.sent[1:]]
    assert (target_stats["decode_batches"], target_stats["decode_rows"]) == (
        1, len(decode.context) + len(decode.draft_tokens))


async def test_rejection_aborts_and_rolls_the_drafter_back():
    scheduler, target, draft, policy = _scheduler()
    seq = scheduler._add(_request(), policy)
    _chunks(scheduler, seq, 3, [10])
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_NONE)  # prefill
    for pos, tok in ((4, 11), (5, 12), (6, 13)):
        _chunks(scheduler, seq, pos, [tok])
    # In flight: [10]. Its verdict: rejected, recovered 50.
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_RECOVERED, 50)
    assert seq.committed == [1, 2, 3, 50] and seq.epoch == 1
    reset = [c for m in draft.sent for c in m.commands if c.kind == pb.DRAFT_COMMAND_KIND_RESET][-1]
    assert (reset.epoch, reset.start_pos, list(reset.tail)) == (1, 3, [50])
    assert seq.stats.pre_verify_aborts == 1 and seq.stats.wasted_draft_tokens == 4
    # A chunk from the aborted branch is dropped and counted.
    _chunks_old = pb.DraftChunk(seq_id=seq.seq_id, epoch=0, start_pos=7, tokens=[14])
    scheduler.on_draft_batch(pb.DraftChunkBatch(chunks=[_chunks_old]))
    assert seq.drafts == [] and seq.stats.wasted_draft_tokens == 5


async def test_vanilla_rejections_are_not_pre_verify_aborts():
    scheduler, target, draft, policy = _scheduler(SpeculationMode.VANILLA)
    seq = scheduler._add(_request(), policy)
    for pos, tok in ((3, 10), (4, 11), (5, 12), (6, 13)):
        _chunks(scheduler, seq, pos, [tok])
    assert list(target.sent[-1].items[0].draft_tokens) == [10, 11, 12, 13]
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_RECOVERED, 50)
    assert seq.stats.rejections == 1 and seq.stats.pre_verify_aborts == 0


async def test_mean_accepted_length_counts_committed_tokens():
    scheduler, target, draft, policy = _scheduler()
    seq = scheduler._add(_request(sampling=SamplingParams(temperature=1.0, seed=1)), policy)
    _chunks(scheduler, seq, 3, [10])
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_NONE)  # prefill: no token
    _chunks(scheduler, seq, 4, [11])
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_NONE)  # pearl + sampling: bonus declined
    assert seq.committed == [1, 2, 3, 10]
    assert seq.stats.committed_tokens == 1 and seq.stats.target_forwards == 2
    assert seq.stats.mean_accepted_length == pytest.approx(0.5)


async def test_queued_request_fails_fast_once_the_target_is_lost():
    scheduler, target, draft, policy = _scheduler(max_num_seqs=1)

    async def consume():
        return [e async for e in scheduler.generate(_request(), policy)]

    first = asyncio.create_task(consume())
    second = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    scheduler.supervisor.target_lost()
    for task in (first, second):
        with pytest.raises(Unavailable):
            await asyncio.wait_for(task, 2)


async def test_a_new_tenant_starts_at_the_others_virtual_time():
    scheduler, target, draft, policy = _scheduler()
    scheduler._vtime["a"] = 500.0
    scheduler._add(_request(tenant="a"), policy)  # (its prompt goes to the target at once: charged)
    scheduler._add(_request(tenant="b"), policy)
    assert scheduler._vtime["b"] == scheduler._vtime["a"] > 500.0


async def test_fair_share_charges_each_items_target_rows_by_weight():
    """What a verify item costs the target — its context and its drafts — not what it commits: a
    tenant whose drafts are rejected still pays for verifying them."""
    scheduler, target, draft, policy = _scheduler()
    seq = scheduler._add(_request(tenant="a", weight=2.0), policy)

    def rows_sent() -> int:
        return sum(len(item.context) + len(item.draft_tokens) for batch in target.sent for item in batch.items)

    assert scheduler._vtime["a"] == rows_sent() / 2.0 > 0  # the prompt's prefill
    _chunks(scheduler, seq, 3, [10, 11, 12, 13])
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_NONE)  # prefill-only verdict: the drafts go next
    assert len(target.sent[-1].items[0].draft_tokens) == 4
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_RECOVERED, 50)  # all four rejected: one token
    assert seq.committed == [1, 2, 3, 50]
    assert scheduler._vtime["a"] == rows_sent() / 2.0 and rows_sent() >= 3 + 4 + 1


async def test_unexpected_verdict_batch_is_ignored():
    scheduler, target, draft, policy = _scheduler(SpeculationMode.OFF)
    seq = scheduler._add(_request(), policy)
    scheduler.on_verdict_batch(
        pb.VerdictBatch(batch_id=999, verdicts=[pb.Verdict(seq_id=seq.seq_id, kind=pb.NEXT_TOKEN_KIND_BONUS, next_token=7)])
    )
    assert seq.committed == [1, 2, 3]
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_BONUS, 7)
    assert seq.committed == [1, 2, 3, 7]


async def test_backing_off_under_load_pauses_the_drafter_and_resumes_with_a_reset():
    scheduler, target, draft, _ = _scheduler()
    policy = SpeculationPolicy(mode=SpeculationMode.PEARL, max_draft_tokens=4, max_lookahead=8, adaptive=True)
    scheduler._adapt_draft_length = lambda: None  # the test plays the cost model
    seq = scheduler._add(_request(n=20), policy)
    _chunks(scheduler, seq, 3, [10])
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_NONE)  # prefill; [10] goes out next
    _chunks(scheduler, seq, 4, [11])
    _chunks(scheduler, seq, 5, [12])
    scheduler.pearl_draft_length = 0  # the cost model says speculation no longer pays
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_BONUS, 11)  # accepts 10, bonus 11 matches
    assert seq.draft_paused and seq.committed == [1, 2, 3, 10, 11]
    stop = [c for m in draft.sent for c in m.commands][-1]
    assert stop.kind == pb.DRAFT_COMMAND_KIND_ADVANCE and stop.draft_until == len(seq.committed)
    # Target-only while paused: no drafts in the verify, late draft chunks are dropped.
    assert list(target.sent[-1].items[0].draft_tokens) == []
    _chunks(scheduler, seq, 6, [13])
    assert seq.drafts == []
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_BONUS, 40)
    scheduler.pearl_draft_length = 4  # load went down
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_BONUS, 41)
    assert not seq.draft_paused and seq.committed == [1, 2, 3, 10, 11, 40, 41]
    reset = [c for m in draft.sent for c in m.commands][-1]
    assert reset.kind == pb.DRAFT_COMMAND_KIND_RESET
    # Drafting 12 at position 5 fed positions < 5 (prompt, 10, 11: all committed); it resumes there.
    assert reset.start_pos == 5 and list(reset.tail) == [40, 41]


async def test_a_paused_sequence_never_waits_for_drafts_that_will_not_come():
    scheduler, target, draft, _ = _scheduler()
    policy = SpeculationPolicy(mode=SpeculationMode.PEARL, max_draft_tokens=4, max_lookahead=8, adaptive=True)
    scheduler._adapt_draft_length = lambda: None
    seq = scheduler._add(_request(n=20), policy)
    _chunks(scheduler, seq, 3, [10])
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_NONE)
    scheduler.pearl_draft_length = 0
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_RECOVERED, 30)  # paused after this verdict
    assert seq.draft_paused
    scheduler.pearl_draft_length = 1  # load dropped, but no draft exists: it must still be verified
    sent = len(target.sent)
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_BONUS, 31)
    assert len(target.sent) == sent + 1 or not seq.draft_paused


def _holds_end_by_their_timer_only(monkeypatch):
    """Patience's own clock frozen: a hold of a few ms ends when its timer fires (the event loop runs),
    never because a loaded machine stalled between two statements of a test."""
    import types

    from duospec.coordinator.scheduling import patience

    monkeypatch.setattr(patience, "time", types.SimpleNamespace(monotonic=lambda: 0.0))


async def test_pearl_patience_waits_for_a_fuller_chunk_then_a_stalled_drafter_is_not_waited_for(monkeypatch):
    from duospec.coordinator.scheduling.adaptive import VerifyCostModel

    _holds_end_by_their_timer_only(monkeypatch)

    scheduler, target, draft, _ = _scheduler()
    policy = SpeculationPolicy(mode=SpeculationMode.PEARL, max_draft_tokens=4, max_lookahead=8, adaptive=True)
    scheduler._adapt_draft_length = lambda: None
    scheduler.verify_cost = VerifyCostModel()
    for n in (2, 3, 5, 6) * 2:  # verify ≈ 4 ms whatever the chunk; a draft step 0.5 ms: waiting pays
        scheduler.verify_cost.observe(n, 0.004 + 0.00001 * n)
    scheduler.patience.draft_step_s.observe(0.0005)
    seq = scheduler._add(_request(n=40), policy)
    seq.acceptance.accepted, seq.acceptance.rejected = 8.0, 2.0  # α = 0.8
    _chunks(scheduler, seq, 3, [10])
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_NONE)  # prefill verdict: the target is free
    batches = len(target.sent)
    _chunks(scheduler, seq, 4, [11])
    assert len(target.sent) == batches, "two drafts: the target waits for a fuller chunk"
    _chunks(scheduler, seq, 5, [12])  # three: a fourth would add under 2 % per second; go now
    assert len(target.sent) == batches + 1 and list(target.sent[-1].items[0].draft_tokens) == [10, 11, 12]
    # Rejected at the first draft: the drafter restarts, sends one draft, then stalls.
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_RECOVERED, 50)
    _chunks(scheduler, seq, 4, [20])
    assert len(target.sent) == batches + 1
    await asyncio.sleep(0.05)  # the hold's timer (at most 2 x 3 steps x 0.5 ms + 1 ms) fires
    assert len(target.sent) == batches + 2 and list(target.sent[-1].items[0].draft_tokens) == [20]
    assert scheduler.stats()["patience"]["holds"] == 2
    await scheduler.close()


def _adaptive_pearl(scheduler, verify_s=0.02):
    """An adaptive pearl policy on a scheduler whose costs are measured: a verify ≈ `verify_s` whatever
    the chunk (a slow target: waiting a few 0.5 ms draft steps for a fuller chunk pays), 0.5 ms round
    overhead, the adaptive length itself held at γ."""
    from duospec.coordinator.scheduling.adaptive import VerifyCostModel

    scheduler._adapt_draft_length = lambda: None
    scheduler.verify_cost = VerifyCostModel()
    for n in (2, 3, 5, 6) * 2:
        scheduler.verify_cost.observe(n, verify_s + 0.00001 * n)
    scheduler.patience.draft_step_s.observe(0.0005)
    scheduler.patience.round_overhead_s.observe(0.0005)
    return SpeculationPolicy(mode=SpeculationMode.PEARL, max_draft_tokens=4, max_lookahead=8, adaptive=True)


def _commands(draft, kind):
    return [c for m in draft.sent for c in m.commands if c.kind == kind]


async def _sent_after_any_hold(scheduler, target, batches: int):
    """The verify item that goes out once a patience hold (bounded by its timer) is over."""
    for _ in range(200):
        if len(target.sent) > batches:
            return target.sent[-1].items[0]
        await asyncio.sleep(0.005)
    raise AssertionError("no verify batch went out")


async def _restart_measured(scheduler, target, seq, slow_s=0.01):
    """Prefill, one rejected draft, then the restarted drafter's first draft `slow_s` after the RESET:
    the restart time is measured. Leaves the sequence's second draft under verification."""
    _chunks(scheduler, seq, 3, [10])
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_NONE)  # the prompt's prefill
    assert list((await _sent_after_any_hold(scheduler, target, 1)).draft_tokens) == [10]
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_RECOVERED, 50)
    batches = len(target.sent)
    assert seq.drafts == [] and len(target.sent) == batches, "restart time unmeasured: wait for a draft"
    await asyncio.sleep(slow_s)
    _chunks(scheduler, seq, 4, [20])  # the restarted drafter's first draft
    assert scheduler.stats()["patience"]["first_draft_s"] >= slow_s
    assert list((await _sent_after_any_hold(scheduler, target, batches)).draft_tokens) == [20]


async def test_after_a_restart_the_free_target_takes_the_next_token_and_the_drafts_carry_on(monkeypatch):
    """Right after a rejection no draft exists. Once the drafter's restart time is measured and waiting
    for it does not pay, the free target verifies the sequence with no draft (its bonus is the next
    token); the chunk the drafter sends continues the sequence when it starts with the token the
    target decided — during the round, or after it (then the epoch is kept and the chunk checked)."""
    scheduler, target, draft, _ = _scheduler()
    # The fake links answer at once: the round overhead stays 0, not whatever a loaded machine's stall
    # between two statements would make it (a long one makes waiting for fuller chunks pay).
    monkeypatch.setattr(scheduler.patience.round_overhead_s, "observe", lambda seconds: None)
    policy = _adaptive_pearl(scheduler)
    seq = scheduler._add(_request(n=40), policy)
    seq.acceptance.accepted, seq.acceptance.rejected = 5.0, 5.0  # α = 0.5
    await _restart_measured(scheduler, target, seq)
    batches = len(target.sent)
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_RECOVERED, 60)
    empty = target.sent[-1].items[0]  # no draft, and none waited for: the target takes the token itself
    assert len(target.sent) == batches + 1 and list(empty.draft_tokens) == [] and list(empty.context) == [60]
    assert empty.bonus == pb.BONUS_POLICY_SAMPLE
    resets = len(_commands(draft, pb.DRAFT_COMMAND_KIND_RESET))
    _chunks(scheduler, seq, 5, [61, 62])  # drafted while the target works
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_BONUS, 61)
    assert seq.committed == [1, 2, 3, 50, 60, 61] and _committed_events(seq) == [50, 60, 61]
    assert len(_commands(draft, pb.DRAFT_COMMAND_KIND_RESET)) == resets  # the drafter's work stands
    assert _commands(draft, pb.DRAFT_COMMAND_KIND_ADVANCE)[-1].committed_len == 6
    item = await _sent_after_any_hold(scheduler, target, batches + 1)
    assert list(item.context) == [61] and list(item.draft_tokens) == [62]
    # Accepted whole, with nothing drafted past it yet: the drafter restarts, as it always did after an
    # unguessed bonus, and the free target goes on empty.
    epoch = seq.epoch
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_BONUS, 63)
    assert seq.committed[3:] == [50, 60, 61, 62, 63] and seq.epoch == epoch + 1
    assert len(target.sent) == batches + 3 and list(target.sent[-1].items[0].draft_tokens) == []
    # The empty round's verdict comes before the drafter's chunk: the epoch stays, and the chunk is
    # checked against the decided token when it comes.
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_BONUS, 64)
    assert seq.committed[-1] == 64 and seq.epoch == epoch + 1
    # The drafter is not told that position 8 is verified: what it holds there is its own guess.
    assert _commands(draft, pb.DRAFT_COMMAND_KIND_ADVANCE)[-1].committed_len == 8
    _chunks(scheduler, seq, 8, [64, 65, 66])  # 64 was decided, as drafted; 65, 66 ride on
    assert seq.epoch == epoch + 1 and seq.drafts == [65, 66]
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_BONUS, 65)  # the next empty round: guessed
    assert seq.drafts == [66] and seq.epoch == epoch + 1
    assert _commands(draft, pb.DRAFT_COMMAND_KIND_ADVANCE)[-1].committed_len == 10  # its chunk showed 64
    assert list((await _sent_after_any_hold(scheduler, target, batches + 4)).draft_tokens) == [66]
    # A late chunk that guessed a decided token wrong starts the drafter over.
    seq.acceptance.accepted, seq.acceptance.rejected = 3.0, 7.0  # α about 0.4 again, as at the restarts before
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_BONUS, 67)  # restart; an empty round
    assert list(target.sent[-1].items[0].draft_tokens) == [] and list(target.sent[-1].items[0].context) == [67]
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_BONUS, 68)
    assert seq.epoch == epoch + 2
    assert _commands(draft, pb.DRAFT_COMMAND_KIND_ADVANCE)[-1].committed_len == len(seq.committed) - 1
    _chunks(scheduler, seq, 12, [99, 100])
    assert seq.epoch == epoch + 3 and seq.drafts == []
    reset = _commands(draft, pb.DRAFT_COMMAND_KIND_RESET)[-1]
    assert reset.epoch == epoch + 3 and list(reset.tail)[-1] == 68
    assert seq.committed[3:] == [50, 60, 61, 62, 63, 64, 65, 66, 67, 68]
    assert _committed_events(seq) == [62, 63, 64, 65, 66, 67, 68]
    await scheduler.close()


def test_a_short_late_chunk_confirms_only_the_decided_tokens_it_holds():
    """Two empty rounds decided positions 3 and 4 before the restarted drafter's chunk came; a chunk
    holding position 3 alone confirms 3, and only the one that holds 4 lets the drafter count all of
    the committed text as verified."""
    scheduler, _, _, policy = _scheduler()
    seq = scheduler._add(_request(n=20), policy)
    for token in (40, 41):
        seq.verify_tokens, seq.spec.empty_round = [], True
        assert seq.apply_verdict(0, token, recovered=False).action.name == "ADVANCE"
    assert seq.committed == [1, 2, 3, 40, 41] and seq.drafter_verified_len() == 3
    assert seq.decided_prefix(3, [40]) == 1
    seq.drafter_holds(3, 1)
    assert seq.drafter_verified_len() == 4
    assert seq.decided_prefix(4, [41, 42]) == 1
    seq.drafter_holds(4, 1)
    assert seq.drafter_verified_len() == 5
    seq.verify_tokens, seq.spec.empty_round = [], True
    seq.apply_verdict(0, 43, recovered=False)
    assert seq.drafter_verified_len() == 5
    seq.start_new_epoch()  # a RESET carries every committed token
    assert seq.drafter_verified_len() == 6


@pytest.mark.parametrize("kind", ["sampled", "vanilla"])
async def test_only_greedy_adaptive_pearl_verifies_without_drafts(kind):
    """A sampled pearl request declines the bonus while drafting (its positions are decided by one rule
    whatever the timing), and vanilla is the fixed baseline: both wait for drafts after a rejection."""
    scheduler, target, draft, _ = _scheduler()
    policy = _adaptive_pearl(scheduler)
    if kind == "vanilla":
        policy = SpeculationPolicy(mode=SpeculationMode.VANILLA, max_draft_tokens=1, max_lookahead=8, adaptive=True)
    scheduler.patience.first_draft_s.observe(0.05)  # a restart as slow as it gets
    sampling = SamplingParams(temperature=1.0, seed=1) if kind == "sampled" else SamplingParams()
    seq = scheduler._add(_request(n=40, sampling=sampling), policy)
    _chunks(scheduler, seq, 3, [10])
    if kind == "sampled":
        _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_NONE)  # the prompt's prefill
        await _sent_after_any_hold(scheduler, target, 1)
    assert list(target.sent[-1].items[0].draft_tokens) == [10]
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_RECOVERED, 50)
    batches = len(target.sent)
    await asyncio.sleep(0.01)
    assert len(target.sent) == batches and seq.drafts == []  # the target waits for the drafter
    _chunks(scheduler, seq, 4, [20])
    assert list((await _sent_after_any_hold(scheduler, target, batches)).draft_tokens) == [20]
    await scheduler.close()


async def test_in_a_batch_that_goes_an_empty_sequence_that_would_wait_stays_out(monkeypatch):
    """Another sequence's full chunk sends the target off; a sequence with no draft yet whose patience
    says wait (a quick restart, a slow target, good drafts) does not ride along empty."""
    from duospec.coordinator.scheduling.scheduler import InFlightVerify

    _holds_end_by_their_timer_only(monkeypatch)

    scheduler, target, draft, _ = _scheduler()
    policy = _adaptive_pearl(scheduler)
    scheduler.inflight = InFlightVerify(0, [], 0.0, 0)  # the target is busy while the scene is set
    a = scheduler._add(_request(n=40, tenant="a"), policy)
    b = scheduler._add(_request(n=40, tenant="b"), policy)
    for seq in (a, b):
        seq.target_len = len(seq.committed) - 1  # prompts read
        seq.acceptance.accepted, seq.acceptance.rejected = 9.0, 1.0  # α = 0.9: drafts are worth it
    a.add_drafts(3, [10, 11, 12], [])
    scheduler.patience.first_draft_s.observe(0.0005)  # b's first draft is a step away
    scheduler.inflight = None
    scheduler._dispatch()
    assert not target.sent and scheduler.patience.holds == 1  # a wants a fourth draft, b its first
    _chunks(scheduler, a, 6, [13])  # a's chunk is full: the target goes, without an empty b
    assert len(target.sent) == 1 and not scheduler.patience.expired
    assert [(i.seq_id, list(i.draft_tokens)) for i in target.sent[-1].items] == [(a.seq_id, [10, 11, 12, 13])]
    await scheduler.close()


async def test_a_chunk_at_decided_positions_with_drafts_in_flight_is_not_taken_on_trust():
    scheduler, target, draft, _ = _scheduler()
    policy = _adaptive_pearl(scheduler)
    seq = scheduler._add(_request(n=40), policy)
    seq.acceptance.accepted, seq.acceptance.rejected = 3.0, 7.0
    await _restart_measured(scheduler, target, seq)  # [20] under verification at position 4
    epoch = seq.epoch
    assert seq.decided_prefix(3, [50]) is None  # position 3 is decided, but drafts are in flight
    _chunks(scheduler, seq, 3, [50])  # a stray chunk: the drafter starts over, nothing is assumed
    assert seq.epoch == epoch + 1 and seq.committed[3:] == [50]
    await scheduler.close()


def _head_verdict(scheduler, target, seq, n_accepted, kind, next_token, features_from, n_features):
    """A verdict carrying the hidden states of the item's committed positions, as the target returns
    them for a head drafter's sequence."""
    features = pb.Features(start_pos=features_from, hidden_size=4, fp16=b"\x00\x3c" * (4 * n_features))
    scheduler.on_verdict_batch(pb.VerdictBatch(batch_id=target.sent[-1].batch_id, verdicts=[pb.Verdict(
        seq_id=seq.seq_id, epoch=seq.epoch, n_accepted=n_accepted, kind=kind, next_token=next_token,
        features=features)]))


async def test_a_head_drafter_goes_on_empty_rounds_and_hears_their_hidden_states(monkeypatch):
    """A head drafter (EAGLE) gets the rejecting verdict's hidden states with its RESET and drafts from
    them while the free target takes the next token on an empty round; that round's hidden state
    follows it (the head re-feeds the row it predicted), and its chunk continues the sequence when it
    guessed the decided token."""
    scheduler, target, draft, _ = _scheduler(draft_method="eagle")
    # the fake links answer at once (see test_after_a_restart_the_free_target_takes_the_next_token...)
    monkeypatch.setattr(scheduler.patience.round_overhead_s, "observe", lambda seconds: None)
    policy = _adaptive_pearl(scheduler)
    scheduler.patience.first_draft_s.observe(0.01)  # the restart is measured: waiting for it does not pay
    seq = scheduler._add(_request(n=40), policy)
    seq.acceptance.accepted, seq.acceptance.rejected = 5.0, 5.0  # α = 0.5
    assert seq.needs_features and list(target.sent[-1].items[0].context) == [1, 2, 3]  # the prompt first
    _head_verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_BONUS, 50, 0, 3)
    kinds = [(c.kind, c.features.start_pos) for c in _commands(draft, pb.DRAFT_COMMAND_KIND_FEATURES)]
    assert kinds == [(pb.DRAFT_COMMAND_KIND_FEATURES, 0)]
    empty = target.sent[-1].items[0]  # the head has the prompt's hidden states now; the target goes on
    assert len(target.sent) == 2 and list(empty.context) == [50] and not empty.draft_tokens and empty.features
    _chunks(scheduler, seq, 4, [51, 52])  # drafted from the prompt's features while the target works
    epoch = seq.epoch
    _head_verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_BONUS, 51, 3, 1)
    assert seq.epoch == epoch and seq.drafts == [52]  # guessed: the drafter's work stands
    assert _commands(draft, pb.DRAFT_COMMAND_KIND_FEATURES)[-1].features.start_pos == 3
    item = await _sent_after_any_hold(scheduler, target, 2)
    assert list(item.context) == [51] and list(item.draft_tokens) == [52]
    # A rejection: the hidden states of what it committed go first, then the RESET; the target does
    # not wait for the restarted head.
    _head_verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_RECOVERED, 70, 4, 1)
    commands = [c for m in draft.sent for c in m.commands]
    assert [(c.kind, c.epoch) for c in commands[-2:]] == [(pb.DRAFT_COMMAND_KIND_FEATURES, epoch),
                                                         (pb.DRAFT_COMMAND_KIND_RESET, epoch + 1)]
    assert commands[-2].features.start_pos == 4
    empty = target.sent[-1].items[0]
    assert len(target.sent) == 4 and list(empty.context) == [70] and not empty.draft_tokens
    _head_verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_BONUS, 71, 5, 1)
    assert seq.epoch == epoch + 1  # the empty round keeps the restarted drafter's epoch
    assert _commands(draft, pb.DRAFT_COMMAND_KIND_FEATURES)[-1].features.start_pos == 5
    _chunks(scheduler, seq, 6, [71, 72])  # late, and it guessed the decided token: 72 rides on
    assert seq.epoch == epoch + 1 and seq.drafts == [72]
    assert seq.committed == [1, 2, 3, 50, 51, 70, 71] and _committed_events(seq) == [50, 51, 70, 71]
    await scheduler.close()
