"""Sampling under a constraint, by exact enumeration: the first committed token of a verify step is
distributed as the masked target p' (the mask applied to p before temperature, top-k and top-p),
whatever q the drafter sent, including a q with mass on illegal tokens.

Exact, not sampled: the verify rule reads its uniforms through `uniform`, which the test replaces;
each decision is a step function of its uniform (accept iff u < a; inverse-CDF sampling), so the
measure of each outcome is found by bisection on the real `verify`, to double precision.

The issue's counterexample: q = {a: .5, illegal: .5}, p' = {a: .5, b: .5}. Cutting the draft at its
first illegal token and sampling the correction from p' gives P(a) = .75; the rule gives .5.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

import duospec.verify.rule as rule
from duospec.sampling import Purpose, SamplingParams, probs_from_logits
from duospec.structured import Constraint, ConstraintKind, GrammarCompiler
from duospec.structured.backend import allocate_bitmask, allowed_tokens, apply_bitmask
from duospec.verify import NextTokenKind, verify
from structured_support import EOS, TOY_IDS, TOY_TOKENS, fake_logits, toy_backend

VOCAB = len(TOY_TOKENS)
A, B, X = TOY_IDS["a"], TOY_IDS["b"], TOY_IDS["x"]
TOP = 1.0 - 2.0 ** -53  # the largest uniform
COMPILER = GrammarCompiler(toy_backend())


def _measures(f) -> dict[int, float]:
    """{value: measure of {u in [0, 1): f(u) == value}} for a nondecreasing integer f, by bisection."""
    out, lo = {}, 0.0
    while True:
        value = f(lo)
        if f(TOP) == value:
            out[value] = out.get(value, 0.0) + (1.0 - lo)
            return out
        a, b = lo, TOP  # f(a) == value != f(b)
        while b - a > 2.0 ** -52 and (a + b) / 2 not in (a, b):
            mid = (a + b) / 2
            a, b = (mid, b) if f(mid) == value else (a, mid)
        out[value] = out.get(value, 0.0) + (b - lo)
        lo = b


def first_token_distribution(monkeypatch, logits: torch.Tensor, q: torch.Tensor, params: SamplingParams,
                             step=verify) -> dict[int, float]:
    """P(first committed token) of one verify step with one draft drawn from q, over every draft token
    and every uniform the rule reads. `logits` [2, V]: already masked."""
    fixed: dict[Purpose, float] = {}
    monkeypatch.setattr(rule, "uniform", lambda seed, pos, purpose: fixed[purpose])
    dist: dict[int, float] = defaultdict(float)

    def outcome(d: int) -> int:  # -1: the draft was accepted
        verdict = step([d], logits, q[None], params, 7, sample_bonus=False)
        return -1 if verdict.n_accepted else verdict.next_token

    for d in torch.nonzero(q).flatten().tolist():
        def accepted(u, d=d):
            fixed[Purpose.ACCEPT], fixed[Purpose.RESIDUAL] = u, 0.0
            return 0 if outcome(d) == -1 else 1

        decided = _measures(accepted)
        dist[d] += float(q[d]) * decided.get(0, 0.0)
        if decided.get(1, 0.0) > 0:
            def recovered(u, d=d):
                fixed[Purpose.ACCEPT], fixed[Purpose.RESIDUAL] = TOP, u
                return outcome(d)

            for token, share in _measures(recovered).items():
                dist[token] += float(q[d]) * decided[1] * share
    return dict(dist)


def _masked(constraint, prefix, logits_row):
    """The target's two verify rows for a one-draft item at `prefix`, masked as the target masks them
    (row 0 by the grammar; row 1 is not read: sample_bonus=False)."""
    matcher = COMPILER.compile(constraint).matcher()
    assert matcher.accept_tokens(prefix) == len(prefix)
    bitmask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.stack([logits_row, logits_row]).clone()
    apply_bitmask(logits, [0], bitmask)
    return logits, allowed_tokens(bitmask[0], VOCAB)


def _close(got: dict, want: torch.Tensor):
    for token in range(VOCAB):
        assert math.isclose(got.get(token, 0.0), float(want[token]), abs_tol=1e-6), (token, got, want.tolist())


def naive_cut(draft_tokens, logits, q, params, start_pos, sample_bonus):
    """The biased scheme the issue warns about: an illegal draft is cut before the rule runs and the
    correction drawn from p' itself (here: with the RESIDUAL uniform)."""
    p = probs_from_logits(logits[:1], params)[0]
    if p[draft_tokens[0]] == 0:
        from duospec.sampling import sample_token

        return rule.Verdict(0, sample_token(p, rule.uniform(params.seed, start_pos, Purpose.RESIDUAL)),
                            NextTokenKind.RECOVERED)
    return verify(draft_tokens, logits, q, params, start_pos, sample_bonus=sample_bonus)


def test_the_issues_counterexample(monkeypatch):
    """q = {a: .5, illegal: .5}; p = {a: .25, b: .25, illegal: .5} masked by "a|b" to p' = {a: .5, b: .5}."""
    p = torch.full((VOCAB,), 1e-30)
    p[A], p[B], p[X] = 0.25, 0.25, 0.5
    logits, legal = _masked(Constraint(ConstraintKind.REGEX, "a|b"), [], p.log())
    assert legal == [A, B]
    q = torch.zeros(VOCAB)
    q[A], q[X] = 0.5, 0.5
    params = SamplingParams(temperature=1.0, seed=3)
    got = first_token_distribution(monkeypatch, logits, q, params)
    assert math.isclose(got[A], 0.5, abs_tol=1e-6) and math.isclose(got[B], 0.5, abs_tol=1e-6)
    # the enumeration sees the bias of cutting at the first illegal token: the check can fail
    biased = first_token_distribution(monkeypatch, logits, q, params, step=naive_cut)
    assert math.isclose(biased[A], 0.75, abs_tol=1e-6)


def _states(constraint):
    """Every legal prefix of a finite language (BFS over the toy vocabulary), the end token excluded."""
    out, frontier = [], [[]]
    while frontier:
        prefix = frontier.pop()
        out.append(prefix)
        _, legal = _masked(constraint, prefix, torch.zeros(VOCAB))
        frontier.extend(prefix + [t] for t in legal if t != EOS)
    return out


FINITE = Constraint(ConstraintKind.REGEX, "(ab|ba|aa)c?")
PARAMS = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.7, top_k=3, seed=2),
          SamplingParams(temperature=1.3, top_p=0.8, seed=3)]


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.7-topk3", "t1.3-topp0.8"])
def test_every_state_of_a_finite_language_follows_the_masked_target(monkeypatch, params):
    states = _states(FINITE)
    assert len(states) >= 8  # a, b, ab, aa, ba, abc, ... (several tokenizations of each string)
    for prefix in states:
        logits, legal = _masked(FINITE, prefix, fake_logits(prefix))
        want = probs_from_logits(logits[:1], params)[0]
        assert set(torch.nonzero(want).flatten().tolist()) <= set(legal)
        drafters = {
            "raw": torch.softmax(fake_logits([X, *prefix]), -1),  # unmasked: mass on illegal tokens
            "masked-draft": _masked_q(fake_logits([X, *prefix]), legal),  # a drafter that masks itself
            "illegal": _only(sorted(set(range(VOCAB)) - set(legal)) or legal),
            "masked-target": want,  # a perfect masked drafter: everything accepted
        }
        for name, q in drafters.items():
            got = first_token_distribution(monkeypatch, logits, q, params)
            try:
                _close(got, want)
            except AssertionError as exc:
                raise AssertionError(f"state {prefix}, drafter {name}: {exc}") from None


def _masked_q(logits, legal):
    """The q of a drafter that masks its own logits with the grammar (what draft_worker sends)."""
    masked = torch.full_like(logits, float("-inf"))
    masked[legal] = logits[legal]
    return torch.softmax(masked, -1)


def _only(tokens):
    q = torch.zeros(VOCAB)
    q[tokens] = 1.0 / len(tokens)
    return q


def test_the_batched_rule_decides_masked_rows_as_the_reference():
    """Masked rows (-inf outside the grammar) through the batched tensor rule a GPU runs give the
    reference's verdicts, greedy and sampled, with q's that put mass on masked-out tokens."""
    from duospec.qcodec import DraftProbs
    from duospec.verify.batch import VerifyTask, verify_batch, verify_each

    gen = torch.Generator().manual_seed(0)
    vocab, rows, tasks = 16, [], []
    for item in range(24):
        k = item % 4
        logits = torch.randn(k + 1, vocab, generator=gen) * 2
        for r in range(k + 1):  # a random non-empty legal set per row
            legal = torch.rand(vocab, generator=gen) < 0.4
            legal[int(torch.randint(vocab, (1,), generator=gen))] = True
            logits[r, ~legal] = float("-inf")
        params = SamplingParams() if item % 3 == 0 else SamplingParams(temperature=0.9, top_k=item % 5, seed=item)
        drafts = torch.randint(vocab, (k,), generator=gen).tolist()
        probs = None
        if not params.greedy and k:
            probs = [DraftProbs.from_probs(torch.softmax(torch.randn(vocab, generator=gen), -1)) for _ in range(k)]
            drafts = [int(q.token_ids[int(torch.randint(len(q.token_ids), (1,), generator=gen))]) for q in probs]
        tasks.append(VerifyTask(drafts, sum(r.shape[0] for r in rows), params, 10 + item, draft_probs=probs))
        rows.append(logits)
    flat = torch.cat(rows)
    assert verify_batch(flat, tasks) == verify_each(flat, tasks)
