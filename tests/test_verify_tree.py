"""The token-tree verify rule (duospec.verify.verify_tree), greedy: scenario tables, and a chain is the
one-child tree (the same verdicts as `verify` over randomized cases)."""

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
    ([-1, 0], SamplingParams(temperature=1.0, seed=1), "chains"),
])
def test_bad_trees_are_refused(parents, params, match):
    with pytest.raises(ValueError, match=match):
        verify_tree([1, 2], parents, _logits([1, 2, 3]), params, 0)
