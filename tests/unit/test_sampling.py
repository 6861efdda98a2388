"""Sampling parameters, counter-based uniforms, logits → probabilities, inverse-CDF sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from duospec.sampling import (
    Purpose,
    SamplingParams,
    probs_from_logits,
    sample_target,
    sample_token,
    sample_tokens,
    uniform,
    uniforms,
)

torch.set_num_threads(1)

NEG_INF = float("-inf")


# --- SamplingParams.validate -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 1 << 64}, "seed"),
    ],
)
def test_validate_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).validate()


def test_validate_accepts_boundaries():
    SamplingParams().validate()
    SamplingParams(temperature=0.7, top_k=50, top_p=1.0, seed=(1 << 64) - 1).validate()
    SamplingParams(temperature=2.0, top_p=1e-6).validate()


# --- uniform -----------------------------------------------------------------------------------


def test_uniform_is_a_pure_function_in_unit_interval():
    keys = [(s, pos, purpose) for s in range(50) for pos in range(20) for purpose in Purpose]
    values = [uniform(*key) for key in keys]
    assert all(0.0 <= v < 1.0 for v in values)
    assert values == [uniform(*key) for key in keys]
    assert len(set(values)) == len(values)


def test_uniform_depends_on_every_key_part():
    base = uniform(7, 100, Purpose.ACCEPT)
    assert uniform(8, 100, Purpose.ACCEPT) != base
    assert uniform(7, 101, Purpose.ACCEPT) != base
    assert uniform(7, 100, Purpose.RESIDUAL) != base


def test_uniforms_is_bit_identical_to_uniform():
    seeds = np.array([0, 1, 2, 12345, (1 << 63) - 1, 1 << 63, (1 << 64) - 1], dtype=np.uint64)
    for position in (0, 1, 999, (1 << 40) + 3):
        for purpose in Purpose:
            vec = uniforms(seeds, position, purpose)
            scalar = [uniform(int(s), position, purpose) for s in seeds]
            assert vec.tolist() == scalar


def test_uniforms_are_uniform_and_independent_across_purposes():
    seeds = np.arange(100_000, dtype=np.uint64)
    draws = {purpose: uniforms(seeds, 17, purpose) for purpose in Purpose}
    for values in draws.values():
        assert stats.kstest(values, "uniform").pvalue > 1e-3
    assert abs(np.corrcoef(draws[Purpose.DRAFT], draws[Purpose.ACCEPT])[0, 1]) < 0.02
    # Consecutive positions of one seed, as a sequence uses them.
    by_position = np.array([uniform(3, pos, Purpose.TARGET) for pos in range(20_000)])
    assert stats.kstest(by_position, "uniform").pvalue > 1e-3


def test_uniform_rejects_out_of_range_keys():
    with pytest.raises(ValueError, match="seed"):
        uniform(-1, 0, Purpose.DRAFT)
    with pytest.raises(ValueError, match="position"):
        uniform(0, -1, Purpose.DRAFT)
    with pytest.raises(ValueError, match="seeds"):
        uniforms(np.array([-1, 2]), 0, Purpose.DRAFT)


# --- probs_from_logits -------------------------------------------------------------------------


def test_greedy_is_one_hot_argmax_lowest_index_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    probs = probs_from_logits(logits, SamplingParams(temperature=0.0, top_k=1, top_p=0.1))
    assert probs.dtype == torch.float32
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_temperature_scales_before_softmax():
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0]])
    probs = probs_from_logits(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.5, dim=-1))


def test_top_k_keeps_the_k_largest_and_ties_at_the_threshold():
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0, 0.0], [1.0, 2.0, 2.0, 0.0, 2.0]])
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    expected_first = torch.softmax(torch.tensor([4.0, 3.0]), dim=0)
    assert probs[0, [0, 2, 4]].tolist() == [0.0, 0.0, 0.0]
    torch.testing.assert_close(probs[0, [1, 3]], expected_first)
    # Three tokens tie at the 2nd-largest value: all three stay, equally likely.
    torch.testing.assert_close(probs[1], torch.tensor([0.0, 1 / 3, 1 / 3, 0.0, 1 / 3]))


def test_top_p_keeps_the_smallest_nucleus_reaching_top_p():
    # softmax of log-probs gives back the probs: [0.5, 0.3, 0.15, 0.05]
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = SamplingParams(temperature=1.0, top_p=0.8)
    torch.testing.assert_close(
        probs_from_logits(logits, params), torch.tensor([[0.625, 0.375, 0.0, 0.0]])
    )
    # top_p just above 0.8 needs the third token too.
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.81))
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    # The most likely token always survives, however small top_p is.
    tiny = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=1e-9))
    assert tiny.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_top_p_applies_to_the_renormalised_top_k_distribution():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # top-k=2 leaves [0.571, 0.429]; top-p=0.5 on that keeps only the first token. Applied to the
    # original distribution, top-p=0.5 would keep two tokens.
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_rows_are_independent_of_the_batch_they_are_computed_in():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 301, generator=generator) * 3
    for params in (
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.2, top_k=20, top_p=0.9),
    ):
        batched = probs_from_logits(logits, params)
        for i in range(logits.shape[0]):
            assert torch.equal(batched[i], probs_from_logits(logits[i : i + 1], params)[0])
        torch.testing.assert_close(batched.sum(dim=-1), torch.ones(7))


def test_masked_vocabulary_stays_at_zero():
    logits = torch.tensor([[NEG_INF, 0.0, 1.0, NEG_INF]])
    probs = probs_from_logits(logits, SamplingParams(temperature=1.0))
    assert probs[0, 0] == 0.0 and probs[0, 3] == 0.0


@pytest.mark.parametrize(
    "logits, message",
    [
        (torch.tensor([[0.0, float("nan")]]), "NaN"),
        (torch.tensor([[NEG_INF, NEG_INF]]), "-inf"),
        (torch.tensor([0.0, 1.0]), "2-D"),
        (torch.tensor([[1, 2]]), "floating"),
    ],
)
def test_bad_logits_are_rejected(logits, message):
    with pytest.raises(ValueError, match=message):
        probs_from_logits(logits, SamplingParams(temperature=1.0))


# --- sample_token ------------------------------------------------------------------------------


def test_sample_token_inverts_the_cdf():
    row = torch.tensor([0.2, 0.5, 0.3])
    assert sample_token(row, 0.0) == 0
    assert sample_token(row, 0.19) == 0
    assert sample_token(row, 0.2) == 1
    assert sample_token(row, 0.69) == 1
    assert sample_token(row, 0.71) == 2
    # Unnormalised rows are scaled, not truncated.
    assert sample_token(row * 7, 0.71) == 2


def test_sample_token_never_returns_a_zero_probability_token():
    row = torch.tensor([0.0, 0.0, 0.25, 0.0, 0.75, 0.0, 0.0])
    largest_below_one = 1.0 - 2.0**-53
    for u in (0.0, 1e-300, 0.25, largest_below_one):
        assert row[sample_token(row, u)] > 0
    # Mass that rounds to slightly under the scaled u must not step past the last positive token.
    uneven = torch.tensor([1e-8, 0.0, 1.0 - 1e-8, 0.0], dtype=torch.float64)
    assert sample_token(uneven, largest_below_one) == 2
    us = np.linspace(0.0, largest_below_one, 10_001)
    drawn = sample_tokens(row, us)
    assert set(drawn.tolist()) == {2, 4}


@pytest.mark.parametrize(
    "row, u, message",
    [
        (torch.tensor([0.5, 0.5]), 1.0, r"\[0, 1\)"),
        (torch.tensor([0.5, 0.5]), -0.1, r"\[0, 1\)"),
        (torch.tensor([0.0, 0.0]), 0.5, "no positive mass"),
        (torch.tensor([0.5, -0.1]), 0.5, "non-negative"),
        (torch.tensor([[0.5, 0.5]]), 0.5, "1-D"),
    ],
)
def test_sample_token_rejects_bad_input(row, u, message):
    with pytest.raises(ValueError, match=message):
        sample_token(row, u)


def test_sample_tokens_matches_sample_token():
    row = torch.tensor([0.1, 0.0, 0.4, 0.2, 0.3])
    us = uniforms(np.arange(500, dtype=np.uint64), 4, Purpose.TARGET)
    assert sample_tokens(row, us).tolist() == [sample_token(row, float(u)) for u in us]


# --- sample_target -----------------------------------------------------------------------------


def test_sample_target_greedy_is_argmax_lowest_index():
    row = torch.tensor([0.0, 2.0, 2.0, 1.0])
    assert sample_target(row, SamplingParams(), position=5) == 1


def test_sample_target_uses_the_target_uniform_of_its_position():
    row = torch.tensor([0.3, -0.2, 1.0, 0.0, 0.5])
    for seed in range(50):
        params = SamplingParams(temperature=0.9, top_k=4, seed=seed)
        probs = probs_from_logits(row.unsqueeze(0), params)[0]
        u = uniform(seed, 11, Purpose.TARGET)
        assert sample_target(row, params, 11) == sample_token(probs, u)


def test_sample_target_follows_p():
    row = torch.tensor([0.3, -0.2, 1.0, 0.0, 0.5, -3.0])
    n = 4000
    draws = [sample_target(row, SamplingParams(temperature=1.0, seed=s), 2) for s in range(n)]
    counts = np.bincount(draws, minlength=6)
    p = torch.softmax(row.double(), dim=0).numpy()
    assert stats.chisquare(counts, n * p / p.sum()).pvalue > 1e-3
