"""Constrained sequences' rounds in the scheduler. Grammar-forced drafts (DraftChunk.forced,
draft_worker/grammar_masks.py) ride along free — the draft cap counts the drafter's own drafts only,
forced ones after the last counted draft go too — and the acceptance estimate that sizes the drafts
counts only the drafter's own. A verdict that stops at a dead end of the grammar ends its sequence
with the tokens before it and a finish reason of its own."""

from __future__ import annotations

import pytest

from duospec.coordinator.api import FinishEvent, FinishReason
from duospec.internal.v1 import pearl_pb2 as pb
from test_scheduler import _request, _scheduler, _verdict


def _chunk(scheduler, seq, pos, tokens, forced=False):
    scheduler.on_draft_batch(pb.DraftChunkBatch(chunks=[pb.DraftChunk(
        seq_id=seq.seq_id, epoch=seq.epoch, start_pos=pos, tokens=tokens, forced=forced)]))


def _under_verification(n=30):
    """Prompt [1, 2, 3] prefilled, draft [10] at 3 under verification; then, while it is verified: a
    forced run [20, 21, 22], the drafter's own [30..33], a forced [40, 41] and its own [50]."""
    scheduler, target, _, policy = _scheduler()  # max_draft_tokens 4, not adaptive
    seq = scheduler._add(_request(n=n), policy)
    _chunk(scheduler, seq, 3, [10])
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_NONE)  # the prompt's prefill round
    assert list(target.sent[-1].items[0].draft_tokens) == [10]
    _chunk(scheduler, seq, 4, [20, 21, 22], forced=True)
    _chunk(scheduler, seq, 7, [30, 31, 32, 33])
    _chunk(scheduler, seq, 11, [40, 41], forced=True)
    _chunk(scheduler, seq, 13, [50])
    return scheduler, target, seq


def test_forced_drafts_do_not_count_toward_the_draft_cap():
    scheduler, target, seq = _under_verification()
    assert seq.free_drafts == 5
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_BONUS, 20)  # [10] accepted, the bonus is the draft
    # the cap of 4 counts 30..33; the forced around them go along; 50 (a fifth of its own) waits
    assert list(target.sent[-1].items[0].draft_tokens) == [21, 22, 30, 31, 32, 33, 40, 41]
    assert seq.drafts == [50]


def test_the_length_limit_still_bounds_a_verify():
    scheduler, target, seq = _under_verification(n=6)  # 10, 20 and four more at most
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_BONUS, 20)
    assert list(target.sent[-1].items[0].draft_tokens) == [21, 22, 30, 31]


def test_the_acceptance_estimate_counts_the_drafters_own_drafts_only():
    scheduler, target, seq = _under_verification()
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_BONUS, 20)
    tracker = seq.acceptance
    accepted, rejected = tracker.accepted, tracker.rejected
    # 21, 22 (forced), 30, 31 accepted; 32 rejected: two of the drafter's own accepted, one rejected
    _verdict(scheduler, target, seq, 4, pb.NEXT_TOKEN_KIND_RECOVERED, 99)
    assert seq.committed[-5:] == [21, 22, 30, 31, 99]
    assert tracker.accepted == tracker.decay * accepted + 2
    assert tracker.rejected == tracker.decay * rejected + 1
    assert seq.forced == set()  # the new epoch dropped the drafts and their marks
    assert seq.stats.accepted_tokens == 1 + 4  # statistics count every accepted draft, forced or not


def test_a_round_of_forced_drafts_only_leaves_the_estimate_alone():
    scheduler, target, _, policy = _scheduler()
    seq = scheduler._add(_request(), policy)
    _chunk(scheduler, seq, 3, [10])
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_NONE)
    _chunk(scheduler, seq, 4, [20, 21], forced=True)
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_BONUS, 20)
    assert list(target.sent[-1].items[0].draft_tokens) == [21]
    tracker = seq.acceptance
    before = (tracker.accepted, tracker.rejected)
    _verdict(scheduler, target, seq, 1, pb.NEXT_TOKEN_KIND_BONUS, 7)
    assert (tracker.accepted, tracker.rejected) == before


def test_a_verdict_at_a_dead_end_ends_the_sequence_with_its_tokens():
    scheduler, target, seq = _under_verification()
    batch = target.sent[-1]
    scheduler.on_verdict_batch(pb.VerdictBatch(batch_id=batch.batch_id, verdicts=[pb.Verdict(
        seq_id=seq.seq_id, epoch=seq.epoch, n_accepted=1, kind=pb.NEXT_TOKEN_KIND_NONE, grammar_dead_end=True)]))
    events = []
    while not seq.events.empty():
        events.append(seq.events.get_nowait())
    finish = events[-1]
    assert isinstance(finish, FinishEvent) and finish.finish_reason is FinishReason.GRAMMAR_DEAD_END
    assert seq.committed[3:] == [10] and finish.completion_tokens == 1
    assert seq.seq_id not in scheduler.sequences  # released on both workers


@pytest.mark.parametrize("reason", list(FinishReason))
def test_every_finish_reason_has_a_name_on_both_fronts(reason):
    from duospec.coordinator.serving.openai_protocol import finish_reason
    from duospec.coordinator.serving.service import _FINISH_TO_PB

    assert finish_reason(reason) and _FINISH_TO_PB[reason]


async def test_vanilla_waits_for_a_chunk_of_its_own_drafts_and_takes_the_forced_ones_along():
    from duospec.coordinator.api import SpeculationMode

    scheduler, target, _, policy = _scheduler(SpeculationMode.VANILLA)  # γ = 4
    seq = scheduler._add(_request(), policy)
    _chunk(scheduler, seq, 3, [20, 21], forced=True)
    _chunk(scheduler, seq, 5, [30, 31, 32])
    assert not target.sent  # 3 of its own: not yet a chunk
    _chunk(scheduler, seq, 8, [33])
    assert list(target.sent[-1].items[0].draft_tokens) == [20, 21, 30, 31, 32, 33]


async def test_vanilla_near_the_length_limit_goes_with_the_forced_drafts_it_has():
    from duospec.coordinator.api import SpeculationMode

    scheduler, target, _, policy = _scheduler(SpeculationMode.VANILLA)
    seq = scheduler._add(_request(n=2), policy)  # two tokens at most, both forced
    _chunk(scheduler, seq, 3, [20, 21], forced=True)
    assert list(target.sent[-1].items[0].draft_tokens) == [20, 21]


def test_an_item_the_target_left_unanswered_is_sent_again():
    """The target leaves out an item whose constraint still compiles (target_worker/verifier.py): no
    verdict, no error. The sequence loses nothing and goes out again in the next round."""
    scheduler, target, _, policy = _scheduler()
    seq = scheduler._add(_request(), policy)
    first = target.sent[-1]
    assert [(i.seq_id, i.start_pos, list(i.context)) for i in first.items] == [(seq.seq_id, 0, [1, 2, 3])]
    scheduler.on_verdict_batch(pb.VerdictBatch(batch_id=first.batch_id))  # left out
    again = target.sent[-1]
    assert again.batch_id != first.batch_id and seq.finish_reason is None
    assert [(i.seq_id, i.start_pos, list(i.context)) for i in again.items] == [(seq.seq_id, 0, [1, 2, 3])]
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_BONUS, 7)
    assert seq.committed[-1] == 7
