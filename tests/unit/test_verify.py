"""The lossless verify rule, tested without models.

1. Scenario tables on hand-built p and q (greedy and sampling) whose verdicts are deterministic.
2. Edge cases: q(x) = 0, p(x) = 0 after truncation, empty residual, input validation.
3. Seeded determinism, and timing independence of seeded output under ``sample_bonus=False``.
4. Chi-square tests that the emitted token follows p. 100k draws per case go through the rule's
   own vectorisable pieces (``uniforms``, ``sample_tokens``, ``acceptance_probability``,
   ``residual_distribution``); every case first checks, seed by seed, that those pieces give the
   same tokens as ``draft_sample`` + ``verify`` themselves, so the statistics are about the real
   function. One case also runs a direct (smaller) chi-square on ``verify`` alone.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from scipy import stats

from duospec.qcodec import DraftProbs, draft_sample
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
from duospec.verify import (
    NextTokenKind,
    Verdict,
    acceptance_probability,
    residual_distribution,
    verify,
)

torch.set_num_threads(1)

RECOVERED, BONUS, NONE = NextTokenKind.RECOVERED, NextTokenKind.BONUS, NextTokenKind.NONE
SAMPLE = SamplingParams(temperature=1.0, seed=1234)
GREEDY = SamplingParams()


def _logits(rows: list[list[float]]) -> torch.Tensor:
    """Probability rows → logits whose softmax (temperature 1) gives them back exactly."""
    probs = torch.tensor(rows, dtype=torch.float64)
    return torch.where(probs > 0, probs.log(), torch.tensor(-math.inf)).float()


def _one_hot(i: int, v: int = 4) -> list[float]:
    return [1.0 if j == i else 0.0 for j in range(v)]


def _half(i: int, j: int, v: int = 4) -> list[float]:
    return [0.5 if t in (i, j) else 0.0 for t in range(v)]


def _draft_probs(rows: list[list[float]]) -> list[DraftProbs]:
    return [DraftProbs.from_probs(torch.tensor(r)) for r in rows]


# --- 1. scenario tables ------------------------------------------------------------------------

# (draft tokens, p rows [k+1], q rows [k], sample_bonus, expected verdict)
SAMPLING_SCENARIOS = {
    "perfect_match_then_bonus": (
        [1, 2],
        [_one_hot(1), _one_hot(2), _one_hot(3)],
        [_one_hot(1), _one_hot(2)],
        True,
        Verdict(2, 3, BONUS),
    ),
    "equal_spread_distributions_accept": (
        [0],
        [_half(0, 1), _one_hot(2)],
        [_half(0, 1)],
        True,
        Verdict(1, 2, BONUS),
    ),
    "early_mismatch": (
        [1, 2, 3],
        [_one_hot(0), _one_hot(2), _one_hot(3), _one_hot(0)],
        [_one_hot(1), _one_hot(2), _one_hot(3)],
        True,
        Verdict(0, 0, RECOVERED),
    ),
    "late_mismatch": (
        [1, 2, 3],
        [_one_hot(1), _one_hot(2), _one_hot(0), _one_hot(0)],
        [_one_hot(1), _one_hot(2), _one_hot(3)],
        True,
        Verdict(2, 0, RECOVERED),
    ),
    "all_rejected": (
        [1, 1, 1],
        [_one_hot(0)] * 4,
        [_one_hot(1)] * 3,
        True,
        Verdict(0, 0, RECOVERED),
    ),
    "residual_picks_what_q_under_covers": (
        [1],
        [_half(2, 3), _one_hot(0)],
        [_half(1, 2)],
        True,
        Verdict(0, 3, RECOVERED),
    ),
    "no_drafts_is_target_sampling": ([], [_one_hot(2)], [], True, Verdict(0, 2, BONUS)),
    "bonus_declined": (
        [1, 2],
        [_one_hot(1), _one_hot(2), _one_hot(3)],
        [_one_hot(1), _one_hot(2)],
        False,
        Verdict(2, None, NONE),
    ),
    "bonus_declined_with_no_drafts": ([], [_one_hot(2)], [], False, Verdict(0, None, NONE)),
    "mismatch_ignores_sample_bonus": (
        [1],
        [_one_hot(0), _one_hot(3)],
        [_one_hot(1)],
        False,
        Verdict(0, 0, RECOVERED),
    ),
}


@pytest.mark.parametrize("name", SAMPLING_SCENARIOS)
def test_sampling_scenarios(name):
    tokens, p_rows, q_rows, sample_bonus, expected = SAMPLING_SCENARIOS[name]
    for seed in range(5):  # deterministic whatever the seed
        params = SamplingParams(temperature=1.0, seed=seed)
        got = verify(
            tokens,
            _logits(p_rows),
            _draft_probs(q_rows),
            params,
            start_pos=7,
            sample_bonus=sample_bonus,
        )
        assert got == expected


# (draft tokens, target logits [k+1], sample_bonus, expected verdict)
GREEDY_SCENARIOS = {
    "perfect_match_then_bonus": (
        [1, 2],
        [[0, 9, 1, 0], [0, 1, 9, 0], [0, 0, 1, 9]],
        True,
        Verdict(2, 3, BONUS),
    ),
    "early_mismatch": (
        [1, 2],
        [[9, 1, 0, 0], [0, 1, 9, 0], [0, 0, 1, 9]],
        True,
        Verdict(0, 0, RECOVERED),
    ),
    "late_mismatch": (
        [1, 2, 3],
        [[0, 9, 0, 0], [0, 0, 9, 0], [9, 0, 0, 0], [1, 0, 0, 0]],
        True,
        Verdict(2, 0, RECOVERED),
    ),
    "all_rejected": (
        [3, 3],
        [[9, 0, 0, 0], [9, 0, 0, 0], [9, 0, 0, 0]],
        True,
        Verdict(0, 0, RECOVERED),
    ),
    "tie_goes_to_lowest_index": ([2], [[0, 5, 5, 0], [0, 0, 0, 1]], True, Verdict(0, 1, RECOVERED)),
    "no_drafts_is_target_argmax": ([], [[0, 0, 3, 1]], True, Verdict(0, 2, BONUS)),
    "bonus_declined": ([1], [[0, 9, 0, 0], [0, 0, 9, 0]], False, Verdict(1, None, NONE)),
}


@pytest.mark.parametrize("name", GREEDY_SCENARIOS)
def test_greedy_scenarios(name):
    tokens, logits, sample_bonus, expected = GREEDY_SCENARIOS[name]
    logits = torch.tensor(logits, dtype=torch.float32)
    # Greedy ignores q entirely, so nothing needs to be sent.
    got = verify(tokens, logits, None, GREEDY, start_pos=0, sample_bonus=sample_bonus)
    assert got == expected


def test_bonus_is_exactly_sample_target():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 40, generator=generator)
    for seed in range(30):
        params = SamplingParams(temperature=0.9, top_k=30, seed=seed)
        q_rows = probs_from_logits(logits[:2], params)  # q == p: both drafts accepted
        tokens = [int(torch.argmax(q_rows[0])), int(torch.argmax(q_rows[1]))]
        got = verify(tokens, logits, q_rows, params, start_pos=100)
        assert got.n_accepted == 2 and got.kind is BONUS
        assert got.next_token == sample_target(logits[2], params, 102)


# --- 2. edge cases -----------------------------------------------------------------------------


def test_draft_token_outside_q_support_is_rejected_without_arithmetic_warnings():
    p_rows = [_half(0, 1), _one_hot(0)]
    q = torch.tensor([_one_hot(0)])  # q(2) = 0: the drafter could not have drawn 2
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        got = verify([2], _logits(p_rows), q, SAMPLE, start_pos=3)
    assert got.n_accepted == 0 and got.kind is RECOVERED
    # residual = max(0, p - q) = {1: 0.5}
    assert got.next_token == 1


def test_token_truncated_from_p_is_always_rejected():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=1.0, top_k=2)
    q = torch.tensor([[0.0, 0.0, 1.0, 0.0]])  # drafter sure of token 2, outside p's top-2
    for seed in range(20):
        got = verify([2], logits, q, SamplingParams(temperature=1.0, top_k=2, seed=seed), 0)
        assert got.n_accepted == 0 and got.next_token in (0, 1)
    assert acceptance_probability(0.0, 0.7) == 0.0
    assert verify([2], logits, q, params, 0).kind is RECOVERED


def test_empty_residual_falls_back_to_p():
    p_row = np.array([0.5, 0.5, 0.0, 0.0])
    assert residual_distribution(p_row, p_row).tolist() == p_row.tolist()
    # A rejection with p == q can only come from a token neither could emit; the answer is from p.
    logits = _logits([_half(0, 1), _one_hot(0)])
    q = torch.tensor([_half(0, 1)])
    for seed in range(10):
        params = SamplingParams(temperature=1.0, seed=seed)
        got = verify([3], logits, q, params, start_pos=2)
        expected = sample_token(torch.tensor(p_row), uniform(seed, 2, Purpose.RESIDUAL))
        assert got == Verdict(0, expected, RECOVERED)


def test_acceptance_probability_is_min_one_ratio():
    got = acceptance_probability(np.array([0.2, 0.6, 0.0, 0.3]), np.array([0.4, 0.3, 0.5, 0.0]))
    assert got.tolist() == [0.5, 1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"target_logits": torch.zeros(2, 4)}, "expected k\\+1 = 3"),
        ({"target_logits": torch.zeros(3)}, "2-D"),
        ({"draft_tokens": [1, 4]}, "outside the target vocabulary"),
        ({"draft_probs": None}, "draft_probs is None"),
        ({"draft_probs": _draft_probs([_one_hot(1)])}, "one DraftProbs per draft token"),
        ({"draft_probs": torch.zeros(2, 5)}, "expected \\[k, V\\]"),
        ({"start_pos": -1}, "start_pos"),
        ({"params": SamplingParams(temperature=1.0, top_p=0.0)}, "top_p"),
    ],
)
def test_bad_input_is_rejected(kwargs, message):
    call = {
        "draft_tokens": [1, 2],
        "target_logits": torch.zeros(3, 4),
        "draft_probs": _draft_probs([_one_hot(1), _one_hot(2)]),
        "params": SAMPLE,
        "start_pos": 0,
    }
    call.update(kwargs)
    with pytest.raises(ValueError, match=message):
        verify(**call)


# --- 3. determinism ----------------------------------------------------------------------------


def _random_chunk(k: int, vocab: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    target = torch.randn(k + 1, vocab, generator=generator) * 2
    draft = target[:k] + torch.randn(k, vocab, generator=generator)
    return target, draft


def test_seeded_verdicts_are_reproducible_and_seed_dependent():
    target, draft = _random_chunk(k=4, vocab=50, seed=0)
    verdicts = set()
    for seed in range(40):
        params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=seed)
        drafted = [draft_sample(draft[i], params, 10 + i) for i in range(4)]
        tokens, q = [t for t, _ in drafted], [d for _, d in drafted]
        first = verify(tokens, target, q, params, 10)
        again = verify(list(tokens), target.clone(), _copied(q), params, 10)
        assert first == again
        verdicts.add((tuple(tokens), first))
    assert len(verdicts) > 10


def _copied(rows: list[DraftProbs]) -> list[DraftProbs]:
    return [DraftProbs.from_bytes(r.to_bytes()) for r in rows]


def _commit(target, draft, params, start, chunk_sizes, sample_bonus=False):
    """Commit len(draft) positions with context-free rows, verifying in the given chunk sizes.

    Rows do not depend on earlier tokens, so after a rejection the drafter's redraft of a
    position is the same draw (same key) as before: only the chunking differs between runs.
    """
    committed, pos, sizes = [], start, list(chunk_sizes)
    end = start + draft.shape[0]
    while pos < end:
        k = min(sizes.pop(0) if sizes else 1, end - pos)
        drafted = [draft_sample(draft[pos - start + i], params, pos + i) for i in range(k)]
        verdict = verify(
            [t for t, _ in drafted],
            target[pos - start : pos - start + k + 1],
            [d for _, d in drafted],
            params,
            pos,
            sample_bonus=sample_bonus,
        )
        committed += [t for t, _ in drafted[: verdict.n_accepted]]
        if verdict.next_token is not None:
            committed.append(verdict.next_token)
        pos = start + len(committed)
    return committed[: draft.shape[0]]


def test_seeded_output_does_not_depend_on_chunking_when_bonus_is_declined():
    target, draft = _random_chunk(k=6, vocab=12, seed=1)
    rejections = 0
    for seed in range(25):
        params = SamplingParams(temperature=1.0, seed=seed)
        reference = _commit(target, draft, params, 40, [1] * 6)
        drafted = [draft_sample(draft[i], params, 40 + i)[0] for i in range(6)]
        rejections += reference != drafted
        for sizes in ([6], [2, 2, 2], [3, 1, 2], [4, 4]):
            assert _commit(target, draft, params, 40, sizes) == reference, (seed, sizes)
    assert rejections > 5  # the property is exercised through rejections, not only acceptances


# --- 4. the emitted token follows p ------------------------------------------------------------

N_DRAWS = 100_000
N_CROSS_CHECK = 500
P_VALUE_FLOOR = 1e-3  # seeds are fixed, so each test is deterministic, not flaky


def _case(vocab: int, spread: float, draft_noise: float, seed: int, disjoint: bool = False):
    generator = torch.Generator().manual_seed(seed)
    target = torch.randn(vocab, generator=generator) * spread
    noise = torch.randn(vocab, generator=generator) * draft_noise
    draft = target + noise
    if disjoint:
        half = vocab // 2
        target[half:] = -math.inf
        draft[:half] = -math.inf
    return target, draft


CASES = {
    "q_close_to_p": (_case(12, 1.0, 0.2, 0), SamplingParams(temperature=1.0)),
    "q_far_from_p": (_case(12, 1.5, 3.0, 1), SamplingParams(temperature=1.3)),
    "disjoint_supports": (_case(12, 1.0, 1.0, 2, disjoint=True), SamplingParams(temperature=1.0)),
    "top_k": (_case(16, 1.5, 1.5, 3), SamplingParams(temperature=0.8, top_k=6)),
    "top_p": (_case(16, 1.5, 1.5, 4), SamplingParams(temperature=1.0, top_p=0.8)),
    "top_k_and_top_p": (
        _case(20, 2.0, 1.0, 5),
        SamplingParams(temperature=1.2, top_k=10, top_p=0.9),
    ),
}


def _p_and_q(target_row, draft_row, params) -> tuple[np.ndarray, np.ndarray]:
    """p as verify computes it; q as the drafter sends it (float16 round trip, renormalised)."""
    p = probs_from_logits(target_row.unsqueeze(0), params)[0].double().numpy()
    q_sent = DraftProbs.from_probs(probs_from_logits(draft_row.unsqueeze(0), params)[0])
    return p, q_sent.dense(draft_row.shape[0]).double().numpy()


def _emitted_vectorised(p, q, seeds, pos) -> np.ndarray:
    """The token emitted at ``pos`` for each seed: the drafted token if accepted, else recovered."""
    drafted = sample_tokens(q, uniforms(seeds, pos, Purpose.DRAFT))
    accepted = uniforms(seeds, pos, Purpose.ACCEPT) < acceptance_probability(p[drafted], q[drafted])
    recovered = sample_tokens(residual_distribution(p, q), uniforms(seeds, pos, Purpose.RESIDUAL))
    return np.where(accepted, drafted, recovered)


def _emitted_by_verify(target_row, draft_row, params, pos) -> int:
    token, dq = draft_sample(draft_row, params, pos)
    logits = torch.stack([target_row, torch.zeros_like(target_row)])
    verdict = verify([token], logits, [dq], params, pos, sample_bonus=False)
    return token if verdict.n_accepted == 1 else verdict.next_token


def _assert_follows(counts: np.ndarray, p: np.ndarray) -> float:
    assert counts[p == 0].sum() == 0, "emitted a token that p gives no mass"
    support = p > 0
    expected = counts.sum() * p[support] / p[support].sum()
    pvalue = stats.chisquare(counts[support], expected).pvalue
    assert pvalue > P_VALUE_FLOOR, pvalue
    return pvalue


@pytest.mark.parametrize("name", CASES)
def test_emitted_token_follows_p(name):
    (target_row, draft_row), base = CASES[name]
    pos = 31
    p, q = _p_and_q(target_row, draft_row, base)
    seeds = np.arange(N_DRAWS, dtype=np.uint64) + 10_000 * (1 + list(CASES).index(name))

    emitted = _emitted_vectorised(p, q, seeds, pos)
    for seed, token in zip(
        seeds[:N_CROSS_CHECK].tolist(), emitted[:N_CROSS_CHECK].tolist(), strict=True
    ):
        params = SamplingParams(base.temperature, base.top_k, base.top_p, seed)
        assert _emitted_by_verify(target_row, draft_row, params, pos) == token, seed

    _assert_follows(np.bincount(emitted, minlength=p.size), p)


def test_chi_square_detects_a_wrong_rule():
    """Negative controls: the same test must fail for the draft distribution and a common bug."""
    (target_row, draft_row), params = CASES["q_far_from_p"]
    p, q = _p_and_q(target_row, draft_row, params)
    seeds = np.arange(N_DRAWS, dtype=np.uint64)
    drafted = sample_tokens(q, uniforms(seeds, 0, Purpose.DRAFT))
    accepted = uniforms(seeds, 0, Purpose.ACCEPT) < acceptance_probability(p[drafted], q[drafted])
    # Bug: resampling from p instead of the residual after a rejection.
    from_p = sample_tokens(p, uniforms(seeds, 0, Purpose.RESIDUAL))
    for wrong in (drafted, np.where(accepted, drafted, from_p)):
        counts = np.bincount(wrong, minlength=p.size)
        support = p > 0
        expected = N_DRAWS * p[support] / p[support].sum()
        pvalue = stats.chisquare(counts[support], expected).pvalue
        assert counts[~support].sum() > 0 or pvalue < 1e-6


def test_verify_alone_follows_p():
    """No vectorised pieces: the verdicts of ``verify`` itself, fewer draws, four tokens."""
    target_row = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4]))
    draft_row = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    p = np.array([0.1, 0.2, 0.3, 0.4])
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(3_000)]
    emitted = [_emitted_by_verify(target_row, draft_row, prm, 3) for prm in params]
    _assert_follows(np.bincount(emitted, minlength=4), p)


def test_two_token_chunk_follows_p_jointly():
    """Both positions of a 2-token chunk: the pair of emitted tokens follows p0 x p1.

    Rows are context-free (a target that ignores its prefix), so the pair should be independent.
    After a rejection at position 0, position 1 is decided by a second 1-token round, as the
    coordinator would do; its draws have the same keys, so the formula per position is the same.
    """
    vocab, start = 6, 50
    generator = torch.Generator().manual_seed(9)
    target = torch.randn(3, vocab, generator=generator) * 1.5
    draft = target[:2] + torch.randn(2, vocab, generator=generator) * 1.5
    base = SamplingParams(temperature=1.0, top_p=0.95)
    (p0, q0), (p1, q1) = (_p_and_q(target[i], draft[i], base) for i in range(2))
    seeds = np.arange(N_DRAWS, dtype=np.uint64) + 777
    first = _emitted_vectorised(p0, q0, seeds, start)
    second = _emitted_vectorised(p1, q1, seeds, start + 1)

    for seed in seeds[:N_CROSS_CHECK].tolist():
        params = SamplingParams(base.temperature, base.top_k, base.top_p, seed)
        committed = _commit(target, draft, params, start, [2], sample_bonus=True)
        assert committed == [first[seed - 777], second[seed - 777]], seed

    joint = np.bincount(first * vocab + second, minlength=vocab * vocab)
    _assert_follows(joint, np.outer(p0, p1).ravel())


def test_a_truncated_q_keeps_the_output_distributed_as_p():
    """Issue 17.5: q on the wire is cut to its likeliest tokens (here 64 of a flat q over 1,000). The
    drafter draws from exactly that truncated q, so the emitted tokens still follow p; the draft
    token itself follows the truncated q, never a token outside it."""
    gen = torch.Generator().manual_seed(17)
    target_row, draft_row = torch.randn(1000, generator=gen) * 2.0, torch.randn(1000, generator=gen) * 0.3
    params = SamplingParams(temperature=1.0)
    p = probs_from_logits(target_row.unsqueeze(0), params)[0].double().numpy()
    sent = DraftProbs.from_probs(probs_from_logits(draft_row.unsqueeze(0), params)[0], max_support=64)
    assert sent.token_ids.size == 64
    q = sent.dense(1000).double().numpy()
    seeds = np.arange(400_000, dtype=np.uint64) + 777
    drafted = sample_tokens(q, uniforms(seeds, 5, Purpose.DRAFT))
    assert set(np.unique(drafted)) <= set(sent.token_ids.tolist())
    emitted = _emitted_vectorised(p, q, seeds, 5)
    _assert_follows(np.bincount(emitted, minlength=1000), p)


def test_q_on_the_wire_is_bounded_for_a_large_vocabulary():
    from duospec.qcodec import MAX_SUPPORT, TAIL_MASS

    flat = torch.softmax(torch.randn(150_000, generator=torch.Generator().manual_seed(3)) * 0.1, 0)
    sent = DraftProbs.from_probs(flat)
    assert sent.token_ids.size == MAX_SUPPORT and len(sent.to_bytes()) == 6 * MAX_SUPPORT
    ranks = torch.randperm(150_000, generator=torch.Generator().manual_seed(4)).double() + 1
    peaked = (ranks ** -3 / (ranks ** -3).sum()).float()  # an LM-like, long-tailed q
    kept = DraftProbs.from_probs(peaked)
    mass = float(peaked[torch.from_numpy(kept.token_ids.astype(np.int64))].sum())
    assert kept.token_ids.size < MAX_SUPPORT and mass >= 1 - TAIL_MASS - 1e-3
