"""Adaptive draft length: the cost model, the acceptance tracker and the choice of k."""

import pytest

from coordinator.adaptive import AcceptanceTracker, VerifyCostModel, best_draft_length, expected_tokens


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
