"""The token-tree verify rule (duospec.verify.verify_tree): greedy scenario tables; a chain is the
one-child tree (the same verdicts as `verify`, greedy and sampled, over randomized cases); and with
sampling the token a position emits follows p (chi-square over 100k seeded draws) for several
(p, q, tree shape) cases, including disjoint supports and top-k / top-p."""

from __future__ import annotations

import pytest
import torch

from duospec.sampling import SamplingParams
from duospec.verify import NextTokenKind, verify, verify_tree

V = 8
GREEDY = SamplingParams()


def _logits(argmax_rows):
    """[len, V] logits whose argmax per row is the given token."""
    out = torch.zeros(len(argmax_rows), V)
    for i, t in enumerate(argmax_rows):
        out[i, t] = 5.0
    return out


# Tree:  node 0 (tok 1) ─ node 1 (tok 2) ─ node 2 (tok 3)      the main chain
#        node 3 (tok 4)   sibling of node 0
#        node 4 (tok 5) under node 0, sibling of node 1 ─ node 5 (tok 6)
TOKENS = [1, 2, 3, 4, 5, 6]
PARENTS = [-1, 0, 1, -1, 0, 4]


@pytest.mark.parametrize("name, argmax, path, kind, next_token", [
    # row r predicts the children of node r-1 (row 0: the roots); rows 1.. follow the nodes
    ("main chain accepted, bonus", [1, 2, 3, 0, 0, 0, 7], (0, 1, 2), NextTokenKind.BONUS, 0),
    ("first sibling accepted", [4, 0, 0, 0, 6, 0, 0], (3,), NextTokenKind.BONUS, 6),
    ("second sibling accepted, deep path", [1, 5, 0, 0, 0, 6, 2], (0, 4, 5), NextTokenKind.BONUS, 2),
    ("all roots rejected", [7, 0, 0, 0, 0, 0, 0], (), NextTokenKind.RECOVERED, 7),
    ("every child of node 0 rejected", [1, 7, 0, 0, 0, 0, 0], (0,), NextTokenKind.RECOVERED, 7),
    ("rejected under the branch", [1, 5, 0, 0, 0, 7, 0], (0, 4), NextTokenKind.RECOVERED, 7),
])
def test_tree_scenarios(name, argmax, path, kind, next_token):
    result = verify_tree(TOKENS, PARENTS, _logits(argmax), GREEDY, 10)
    assert (result.path, result.verdict.kind, result.verdict.next_token) == (path, kind, next_token), name
    assert result.verdict.n_accepted == len(path)


def test_a_declined_bonus_at_a_leaf():
    result = verify_tree(TOKENS, PARENTS, _logits([1, 2, 3, 0, 0, 0, 7]), GREEDY, 10, sample_bonus=False)
    assert result.path == (0, 1, 2) and result.verdict.kind is NextTokenKind.NONE


def test_a_chain_is_the_one_child_tree():
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        k = int(torch.randint(0, 6, (1,), generator=gen))
        logits = torch.randn(k + 1, V, generator=gen)
        argmax = logits.argmax(-1).tolist()
        # Drafts that agree for a random prefix, then random.
        agree = int(torch.randint(0, k + 1, (1,), generator=gen))
        drafts = argmax[:agree] + torch.randint(0, V, (k - agree,), generator=gen).tolist()
        chain = verify(drafts, logits, None, GREEDY, 3)
        tree = verify_tree(drafts, list(range(-1, k - 1)), logits, GREEDY, 3)
        assert tree.verdict == chain and tree.path == tuple(range(chain.n_accepted))


@pytest.mark.parametrize("parents, params, match", [
    ([-1, 1], GREEDY, "parents"),
    ([-1], GREEDY, "parents"),
])
def test_bad_trees_are_refused(parents, params, match):
    with pytest.raises(ValueError, match=match):
        verify_tree([1, 2], parents, _logits([1, 2, 3]), params, 0)


def test_a_sampled_chain_is_the_one_child_tree():
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=1.0, seed=0)
    for seed in range(300):
        params = SamplingParams(temperature=1.0, seed=seed)
        k = int(torch.randint(1, 5, (1,), generator=gen))
        logits = torch.randn(k + 1, V, generator=gen) * 2
        q = torch.softmax(torch.randn(k, V, generator=gen) * 2, dim=-1)
        drafts = torch.multinomial(q, 1, generator=gen).flatten().tolist()
        for bonus in (True, False):
            chain = verify(drafts, logits, q, params, 5, sample_bonus=bonus)
            tree = verify_tree(drafts, list(range(-1, k - 1)), logits, params, 5, draft_probs=q.double().numpy(),
                               sample_bonus=bonus)
            assert tree.verdict == chain and tree.path == tuple(range(chain.n_accepted))


def _first_token_counts(p_logits, q_row, siblings, params, n):
    """Histogram of the token emitted at the first position over n seeds: the main draft x ~ q_row
    (node 0) and deterministic siblings (nodes 1..), all candidates for the same position."""
    import numpy as np

    rng = np.random.default_rng(0)
    xs = rng.choice(V, size=n, p=q_row)
    logits = p_logits.expand(len(siblings) + 2, V).clone()  # rows: the position, then after each node
    counts = np.zeros(V)
    for seed, x in enumerate(xs.tolist()):
        tokens = [x, *siblings]
        result = verify_tree(tokens, [-1] * len(tokens), logits, SamplingParams(
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed), 7,
            draft_probs=[q_row], sample_bonus=False)
        counts[tokens[result.path[0]] if result.path else result.verdict.next_token] += 1
    return counts


@pytest.mark.parametrize("name, p_logits, q_row, siblings, params", [
    ("main + one sibling", [2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2], [0.4, 0.3, 0.1, 0.1, 0.05, 0.05, 0.0, 0.0],
     [6], SamplingParams(temperature=1.0)),
    ("main + two siblings", [0.0, 0.3, 2.0, 1.0, 0.5, 0.1, 1.2, -1.0], [0.05, 0.05, 0.1, 0.5, 0.2, 0.05, 0.0, 0.05],
     [2, 6], SamplingParams(temperature=1.0)),
    ("disjoint supports", [-9.0, -9.0, 1.0, 0.5, 0.0, 0.8, 0.3, 0.1], [0.6, 0.4, 0, 0, 0, 0, 0, 0],
     [1, 3], SamplingParams(temperature=1.0)),
    ("top-k and top-p", [1.0, 0.8, 0.6, 0.4, 0.2, 0.0, -0.2, -0.4], [0.2, 0.1, 0.3, 0.1, 0.1, 0.1, 0.05, 0.05],
     [5, 1], SamplingParams(temperature=0.7, top_k=5, top_p=0.9)),
])
def test_sampled_trees_emit_tokens_distributed_as_p(name, p_logits, q_row, siblings, params):
    import numpy as np

    from duospec.sampling import probs_from_logits
    from exactness import chi_square_pvalue

    # 40k draws over 8 outcomes: a rule off by two percentage points on a 0.2-probability token gives
    # chi-square ~80 on that cell alone (p < 1e-13 at 7 degrees of freedom), far past the 1e-4 bar.
    n = 40_000
    logits = torch.tensor([p_logits])
    q = np.asarray(q_row, dtype=np.float64)
    q /= q.sum()
    counts = _first_token_counts(logits, q, siblings, params, n)
    p = probs_from_logits(logits, SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                                 top_p=params.top_p, seed=0))[0].double().numpy()
    assert counts[p == 0].sum() == 0, f"{name}: emitted a token the target never would"
    joint = {t: float(p[t]) for t in range(V) if p[t] > 0}
    pvalue = chi_square_pvalue(joint, {t: counts[t] for t in joint}, n)
    assert pvalue > 1e-4, f"{name}: chi-square p-value {pvalue:.2g}; counts {counts.tolist()}, expected {(p * n).round()}"
