"""Adaptive draft length: the cost model, the acceptance tracker and the choice of k."""

import pytest

from duospec.coordinator.scheduling.adaptive import (
    AcceptanceTracker,
    Ewma,
    VerifyCostModel,
    best_draft_length,
    drafts_worth_waiting_for,
    expected_tokens,
)
from duospec.coordinator.scheduling.patience import Patience


def _fitted(fixed, per_token, sizes=(2, 5, 9, 14, 20, 33)):
    model = VerifyCostModel()
    for n in sizes * 3:
        model.observe(n, fixed + per_token * n)
    return model


def test_expected_tokens_closed_form():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 1) == pytest.approx(1.5)
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(0.0, 4) == pytest.approx(1.0)


def test_cost_model_recovers_a_line():
    fixed, per_token = _fitted(0.004, 0.0005).coefficients()
    assert fixed == pytest.approx(0.004, rel=1e-6)
    assert per_token == pytest.approx(0.0005, rel=1e-6)


def test_cost_model_needs_data_before_adapting():
    assert best_draft_length([0.9], VerifyCostModel(), max_k=6) == 6


def test_memory_bound_small_batch_drafts_long():
    # One sequence, verify time nearly flat in tokens (decode is memory-bound): long drafts pay.
    assert best_draft_length([0.8], _fitted(0.010, 0.00005), max_k=8) >= 6


def test_poor_acceptance_drafts_short():
    assert best_draft_length([0.1], _fitted(0.010, 0.002), max_k=8) <= 1


def test_large_batch_backs_off_to_target_only():
    # 32 sequences, compute-bound target: every extra token costs as much as a whole forward's fixed part.
    alphas = [0.6] * 32
    assert best_draft_length(alphas, _fitted(0.002, 0.001), max_k=8) == 0


def test_min_k_keeps_speculating_when_required():
    assert best_draft_length([0.6] * 32, _fitted(0.002, 0.001), max_k=8, min_k=1) == 1


def test_vanilla_draft_time_shortens_the_draft():
    cost = _fitted(0.010, 0.0001)
    overlapped = best_draft_length([0.7], cost, max_k=8)
    alternating = best_draft_length([0.7], cost, max_k=8, draft_step_s=0.004)
    assert alternating < overlapped


def test_acceptance_tracker_follows_recent_rounds():
    tracker = AcceptanceTracker()
    for _ in range(20):
        tracker.observe(4, 0)
    assert tracker.alpha > 0.9
    for _ in range(20):
        tracker.observe(0, 1)
    assert tracker.alpha < 0.1


def test_ewma_starts_at_the_first_observation():
    mean = Ewma(decay=0.5)
    assert mean.value is None
    mean.observe(4.0)
    mean.observe(2.0)
    assert mean.value == pytest.approx(3.0)


def test_cheap_drafts_are_worth_waiting_for():
    # A verify costs ~8 draft steps: after a rejection, wait for a fuller chunk instead of one draft.
    k = drafts_worth_waiting_for(0.75, 1, 4, _fitted(0.004, 0.00005), draft_step_s=0.0005)
    assert k in (3, 4)


def test_after_a_rejection_a_slow_restart_is_not_waited_for():
    # No draft yet, and the restarted drafter's first one takes 40 % of a verify: the free target takes
    # the next token itself (an empty round); what the drafter drafts meanwhile is not lost.
    cost = _fitted(0.004, 0.00005)
    assert drafts_worth_waiting_for(0.6, 0, 4, cost, draft_step_s=0.0005, round_overhead_s=0.0005,
                                    first_draft_s=0.0016) == 0
    # A restart quicker than a step of its own, good drafts and a target much dearer than a step:
    # waiting a moment for a full chunk beats taking one token now.
    assert drafts_worth_waiting_for(0.9, 0, 4, _fitted(0.004, 0.00001), draft_step_s=0.0001,
                                    round_overhead_s=0.0005, first_draft_s=0.00005) >= 1
    # Unmeasured restart time: wait for the first draft, as before empty rounds existed.
    assert drafts_worth_waiting_for(0.6, 0, 4, cost, draft_step_s=0.0005) == 1
    assert drafts_worth_waiting_for(0.6, 0, 4, VerifyCostModel(), draft_step_s=0.0005, first_draft_s=0.001) == 1


def test_a_quick_restart_of_a_good_drafter_is_waited_for():
    # Drafts nearly free next to a 4 ms verify and mostly right: a round with one is worth far more
    # than an empty one, and the first comes within 2 % of a verify.
    k = drafts_worth_waiting_for(0.9, 0, 4, _fitted(0.004, 0.00001), draft_step_s=0.00002, first_draft_s=0.00008)
    assert k >= 1


@pytest.mark.parametrize("alpha,k0", [(0.3, 0), (0.6, 0), (0.6, 2), (0.85, 1)])
def test_pipeline_rounds_rate_is_the_long_run_rate_of_the_rounds_it_describes(alpha, k0):
    """The closed form behind patience against a direct simulation of the process it models (i.i.d.
    acceptance α; after a rejection or an unguessed bonus wait for k0 drafts, else verify a full
    chunk): this checks the algebra of the long-run rate, not how well the model fits a real drafter."""
    import random

    from duospec.coordinator.scheduling.adaptive import PipelineRounds

    cost, step, overhead, first, full = _fitted(0.003, 0.0002), 0.0004, 0.0005, 0.0012, 4
    rounds = PipelineRounds(alpha, full, cost, step, overhead, 1, first)
    e_f, t_f, p_f = rounds._round(full, full)
    closed = rounds._rate(k0, e_f, t_f, p_f)
    rng = random.Random(k0)
    tokens = seconds = 0.0
    ready = 0  # drafts ready when a round starts: 0 after a restart, `full` in flow
    for _ in range(200_000):
        k = k0 if ready == 0 else full
        seconds += rounds._round(k, ready)[1]
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        tokens += accepted + 1  # the accepted run and the recovered / bonus token
        ready = full if accepted == k and rng.random() < alpha else 0  # and the drafter guessed the bonus
    assert tokens / seconds == pytest.approx(closed, rel=0.02)
    assert rounds.rate >= closed * (1 - 1e-9)  # the process's rate is the best over k0


def test_drafts_as_slow_as_a_verify_are_pre_verified_at_once():
    assert drafts_worth_waiting_for(0.75, 1, 4, _fitted(0.004, 0.00005), draft_step_s=0.004) == 1


def test_patience_needs_measurements_and_room():
    assert drafts_worth_waiting_for(0.75, 1, 4, VerifyCostModel(), draft_step_s=0.0005) == 1  # no cost model yet
    assert drafts_worth_waiting_for(0.75, 1, 4, _fitted(0.004, 0.00005), draft_step_s=0.0) == 1  # no step time
    assert drafts_worth_waiting_for(0.75, 4, 4, _fitted(0.004, 0.00005), draft_step_s=0.0005) == 4  # full


def test_poor_acceptance_is_not_worth_waiting_for():
    assert drafts_worth_waiting_for(0.1, 1, 4, _fitted(0.004, 0.00005), draft_step_s=0.0005) == 1


async def test_a_hold_ends_by_its_timer():
    import asyncio

    # Waits of 0.5 s (a hold of 2 x 0.5 s + 1 ms): a loaded machine stalling between two statements
    # must not end the hold before the checks that it is still on.
    woken = asyncio.Event()
    patience = Patience(wake=woken.set)
    assert patience.hold([0.5]) and patience.hold([0.25])  # one hold, however often it is asked
    assert not patience.hold([0.5, 0.0]), "a sequence that wants no more drafts releases the target"
    assert not patience.expired
    await asyncio.wait_for(woken.wait(), 30.0)  # the timer fires after ~1 s; generous for a loaded machine
    assert patience.expired
    assert not patience.hold([0.5]), "a hold that timed out does not start again until the batch goes"
    patience.end()
    assert not patience.expired and patience.hold([0.5]) and patience.holds == 2
    patience.end()


def test_pearl_lookahead_leaves_room_for_a_full_chunk_past_the_bonus():
    from duospec.coordinator.api import SpeculationMode
    from duospec.coordinator.scheduling.policies import SpeculationPolicy

    assert SpeculationPolicy(SpeculationMode.PEARL, max_draft_tokens=4, max_lookahead=8).lookahead() == 9
    assert SpeculationPolicy(SpeculationMode.PEARL, max_draft_tokens=4, max_lookahead=16).lookahead() == 16
    assert SpeculationPolicy(SpeculationMode.VANILLA, max_draft_tokens=4, max_lookahead=16).lookahead() == 4
    # A request asking for a large γ runs at most γ past the configured lookahead.
    assert SpeculationPolicy(SpeculationMode.PEARL, max_draft_tokens=64, max_lookahead=9).lookahead() == 73
