"""Prompt lookup in empty rounds (coordinator/scheduling/lookup.py): the index alone, the sequence's bookkeeping
of a round that verified looked-up tokens, and the scheduler with fake links."""

from __future__ import annotations

import dataclasses

import pytest

from duospec.coordinator.scheduling.adaptive import AcceptanceTracker, VerifyCostModel
from duospec.coordinator.config import parse_serve_config
from duospec.coordinator.scheduling.lookup import TextLookup
from duospec.coordinator.scheduling.scheduler import LOOKUP_PROBE_EVERY
from duospec.internal.v1 import pearl_pb2 as pb
from test_scheduler import (
    _adaptive_pearl,
    _chunks,
    _commands,
    _committed_events,
    _request,
    _scheduler,
    _sent_after_any_hold,
    _verdict,
)

# -- the index --------------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens, k, expected", [
    ([5, 6, 7, 8, 9, 5, 6, 7], 4, [8, 9, 5, 6]),  # (5, 6, 7) came before: what followed it, copied
    ([5, 6, 7, 8, 9, 5, 6, 7], 2, [8, 9]),  # at most k
    ([1, 2, 3, 4, 5], 4, []),  # no suffix occurred before (the suffix itself never counts)
    ([1, 2, 9, 1, 2, 8, 4, 1, 2], 3, [8, 4, 1]),  # the latest earlier occurrence wins
    ([3, 4, 1, 2, 5, 9, 9, 4, 1, 2], 2, [5, 9]),  # the longest suffix wins: (4, 1, 2) over (1, 2)
    ([7, 7, 7], 4, [7]),  # a repeat overlapping the suffix: as far as the text goes
    ([1, 2, 1], 4, []),  # one token alone is below min_ngram
])
def test_the_lookup_proposes_what_followed_the_longest_earlier_suffix(tokens, k, expected):
    assert TextLookup().propose(tokens, k) == expected


def test_the_index_grows_with_the_text_and_matches_a_fresh_one():
    """Indexed lazily as the committed tokens grow: every proposal equals a fresh index's."""
    text = [1, 2, 3, 4, 1, 2, 5, 3, 4, 1, 2, 3, 4, 6, 1, 2, 3]
    grown = TextLookup()
    for end in range(2, len(text) + 1):
        assert grown.propose(text[:end], 3) == TextLookup().propose(text[:end], 3)
    assert grown.propose(text, 0) == []


# -- a sequence's round with looked-up tokens --------------------------------------------------------


def _sequence_in_empty_round(lookup_tokens):
    scheduler, _, _, policy = _scheduler()
    seq = scheduler._add(_request(prompt=(5, 6, 7, 8, 9, 5, 6, 7), n=20), policy)
    seq.target_len = len(seq.committed) - 1
    seq.verify_tokens, seq.spec.empty_round, seq.spec.lookup_tokens = [], True, list(lookup_tokens)
    return seq


def test_a_round_commits_the_looked_up_tokens_it_accepted_and_keeps_the_drafters_epoch():
    seq = _sequence_in_empty_round([8, 9, 5, 6])
    outcome = seq.apply_verdict(2, 11, recovered=True)
    assert outcome.kept == (8, 9, 11) and seq.committed[8:] == [8, 9, 11]
    assert outcome.action.name == "ADVANCE" and outcome.branch is None and seq.epoch == 0  # not the drafter's rejection
    assert (outcome.drafted, outcome.looked_up) == (0, 4)
    assert seq.drafter_verified_len() == 8  # what the drafter holds past 8 is its own guess
    assert (seq.stats.lookup_tokens, seq.stats.lookup_accepted) == (4, 2)
    assert (seq.stats.drafted_tokens, seq.stats.accepted_tokens, seq.stats.rejections) == (0, 0, 0)
    assert seq.stats.committed_tokens == 3 and seq.stats.mean_accepted_length == 3.0


def test_drafts_that_came_during_the_round_ride_on_when_they_guessed_every_decided_token():
    seq = _sequence_in_empty_round([8, 9, 5, 6])
    assert seq.add_drafts(8, [8, 9, 11, 12], [])
    action = seq.apply_verdict(2, 11, recovered=True).action
    assert action.name == "ADVANCE" and seq.drafts == [12] and seq.drafter_verified_len() == 11


def test_drafts_that_came_during_the_round_and_guessed_short_confirm_what_they_hold():
    seq = _sequence_in_empty_round([8, 9, 5, 6])
    assert seq.add_drafts(8, [8], [])
    action = seq.apply_verdict(2, 11, recovered=True).action
    assert action.name == "ADVANCE" and seq.drafts == [] and seq.drafter_verified_len() == 9
    assert seq.decided_prefix(9, [9, 11, 13]) == 2  # its next chunk is checked against 9 and 11


def test_drafts_that_guessed_a_decided_token_wrong_restart_the_drafter():
    seq = _sequence_in_empty_round([8, 9, 5, 6])
    assert seq.add_drafts(8, [8, 4, 4], [])
    action = seq.apply_verdict(2, 11, recovered=True).action
    assert action.name == "ABORT" and seq.committed[8:] == [8, 9, 11]


# -- the scheduler ------------------------------------------------------------------------------------


async def _after_a_rejection(monkeypatch, prompt=(5, 6, 7, 8, 9, 5, 6), correction=7, lookup=True):
    """An adaptive greedy pearl sequence whose first draft was rejected, the restart time measured
    (slow: the free target goes at once)."""
    scheduler, target, draft, _ = _scheduler()
    monkeypatch.setattr(scheduler.patience.round_overhead_s, "observe", lambda seconds: None)
    policy = dataclasses.replace(_adaptive_pearl(scheduler), lookup=lookup)
    scheduler.patience.first_draft_s.observe(0.01)
    seq = scheduler._add(_request(prompt=prompt, n=40), policy)
    seq.acceptance.accepted, seq.acceptance.rejected = 5.0, 5.0
    _chunks(scheduler, seq, len(prompt), [10])
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_NONE)  # the prompt's prefill
    assert list((await _sent_after_any_hold(scheduler, target, 1)).draft_tokens) == [10]
    _verdict(scheduler, target, seq, 0, pb.NEXT_TOKEN_KIND_RECOVERED, correction)
    return scheduler, target, draft, seq


async def test_an_empty_round_verifies_the_looked_up_tokens_and_the_drafter_goes_on(monkeypatch):
    scheduler, target, draft, seq = await _after_a_rejection(monkeypatch)
    item = target.sent[-1].items[0]  # no draft: the text after the earlier (5, 6, 7) goes instead
    assert list(item.context) == [7] and list(item.draft_tokens) == [8, 9, 5, 6] and not item.draft_parents
    resets = len(_commands(draft, pb.DRAFT_COMMAND_KIND_RESET))
    _chunks(scheduler, seq, 8, [8, 9, 11, 12])  # the restarted drafter, meanwhile
    batches = len(target.sent)
    _verdict(scheduler, target, seq, 2, pb.NEXT_TOKEN_KIND_RECOVERED, 11)
    assert seq.committed[7:] == [7, 8, 9, 11] and _committed_events(seq) == [7, 8, 9, 11]
    assert len(_commands(draft, pb.DRAFT_COMMAND_KIND_RESET)) == resets  # its work stands
    assert (seq.stats.lookup_tokens, seq.stats.lookup_accepted) == (4, 2)
    tracker, prior = scheduler.lookup_acceptance, AcceptanceTracker(decay=0.95)
    assert (tracker.accepted, tracker.rejected) == pytest.approx((0.95 * prior.accepted + 2, 0.95 * prior.rejected + 1))
    assert list((await _sent_after_any_hold(scheduler, target, batches)).draft_tokens) == [12]  # the drafter's next
    await scheduler.close()


async def test_a_drafter_that_guessed_a_looked_up_token_wrong_is_reset_with_the_decided_tokens(monkeypatch):
    scheduler, target, draft, seq = await _after_a_rejection(monkeypatch)
    _chunks(scheduler, seq, 8, [8, 3])
    epoch = seq.epoch
    _verdict(scheduler, target, seq, 4, pb.NEXT_TOKEN_KIND_BONUS, 7)
    assert seq.committed[7:] == [7, 8, 9, 5, 6, 7] and seq.epoch == epoch + 1
    reset = _commands(draft, pb.DRAFT_COMMAND_KIND_RESET)[-1]  # it drafted 8 right: it goes on from 9
    assert (reset.epoch, reset.start_pos, list(reset.tail)) == (epoch + 1, 9, [9, 5, 6, 7])
    await scheduler.close()


async def test_without_lookup_or_a_match_the_empty_round_stays_empty(monkeypatch):
    for prompt, lookup in (((5, 6, 7, 8, 9, 5, 6), False), ((1, 2, 3, 4, 5, 6, 8), True)):
        scheduler, target, _, seq = await _after_a_rejection(monkeypatch, prompt, lookup=lookup)
        item = target.sent[-1].items[0]
        assert list(item.context) == [7] and list(item.draft_tokens) == [] and seq.spec.empty_round
        await scheduler.close()


def test_lookups_that_do_not_pay_stop_but_one_token_is_still_tried_now_and_then():
    scheduler, _, _, policy = _scheduler()
    seq = scheduler._add(_request(n=40), dataclasses.replace(policy, lookup=True))
    scheduler.verify_cost = VerifyCostModel()
    for n in (1, 2, 3, 5) * 3:  # a flat verify cost (a GPU's memory-bound decode)
        scheduler.verify_cost.observe(n, 0.01 + 0.00001 * n)
    assert scheduler._lookup_length(seq) == 4  # the prior: try all the request allows
    scheduler.verify_cost = VerifyCostModel()
    for n in (1, 2, 3, 5) * 3:  # every verified token costs as much as the forward's fixed part
        scheduler.verify_cost.observe(n, 0.001 * (1 + n))
    for _ in range(40):
        scheduler.lookup_acceptance.observe(0, 1)
    lengths = [scheduler._lookup_length(seq) for _ in range(3 * LOOKUP_PROBE_EVERY)]
    assert lengths.count(1) == 3 and lengths.count(0) == 3 * LOOKUP_PROBE_EVERY - 3


def test_the_serve_config_turns_lookup_off():
    model = {"name": "m", "target": "t", "draft": "d"}
    on = parse_serve_config({"models": [model]}).models[0].speculation
    off = parse_serve_config({"models": [{**model, "speculation": {"lookup": False}}]}).models[0].speculation
    assert on.lookup is True and off.lookup is False


def test_a_drafter_wrong_at_the_first_looked_up_position_is_reset_from_there_and_its_hedges_go():
    """The round decided positions 8-12; the drafter's chunk had guessed 8 otherwise. Its cache stands
    only before 8 (not up to where its chunk reached), and a hedge it drafted on its own line at the
    verdict's last position is not taken as a cache hit."""
    seq = _sequence_in_empty_round([8, 9, 5, 6])
    assert seq.add_drafts(8, [4, 3, 2], [])
    assert seq.add_hedge(12, 7, 13, [21, 22], [])  # drafted after ... 4, 3, 2, ?: not after 8, 9, 5, 6
    action = seq.apply_verdict(4, 7, recovered=False).action
    assert action.name == "ABORT" and seq.committed[8:] == [8, 9, 5, 6, 7]
    assert seq.take_hedge() is None
    assert seq.start_new_epoch() == 8  # the RESET re-feeds from position 8


def test_the_index_covers_only_the_recent_window_of_a_long_text():
    text = [1, 2, 3] + list(range(100, 200)) + [1, 2]
    assert TextLookup(window=200).propose(text, 2) == [3, 100]
    assert TextLookup(window=50).propose(text, 2) == []  # (1, 2) first came before the window
