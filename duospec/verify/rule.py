"""The lossless verify rule: one pure function from (drafts, p, q, params, position) to a verdict.

Glossary (docs/design.md#exactness; vLLM and Leviathan et al. name p and q the other way round in places):

- **p**: the target distribution at a position, ``probs_from_logits(target_logits, params)``.
- **q**: the draft distribution the draft token was sampled from, after the same temperature,
  top-k and top-p (and, across processes, the float16 round trip of ``qcodec.DraftProbs``).
- **accepted tokens**: the longest prefix of the draft tokens that passes the test, position by
  position. Greedy: ``x == argmax p``. Sampling: ``u < p(x) / q(x)`` with
  ``u = uniform(seed, pos, ACCEPT)``, i.e. accept with probability ``min(1, p(x)/q(x))``.
- **recovered token**: after the first rejection, one token from ``norm(max(0, p - q))`` at the
  rejected position (``uniform(seed, pos, RESIDUAL)``); greedy: ``argmax p``.
- **bonus token**: when every draft is accepted, one token from p at the position after the last
  draft, drawn exactly as ``sample_target`` draws it (``uniform(seed, pos, TARGET)``).
- **no next token** (``NextTokenKind.NONE``): every draft accepted and the caller declined the
  bonus (``sample_bonus=False``). PEARL with sampling declines it so that every position is
  decided by the draft-then-verify rule whatever the chunk timing, keeping seeded output
  timing-independent.

Under this rule each emitted token is distributed exactly as p, whatever q is (Leviathan et al.
2023, Chen et al. 2023). Randomness is counter-based, so equal inputs give equal verdicts.

Token trees (`verify_tree`; docs/design.md#beyond-one-chain):

- **tree**: draft tokens with a parent index each (-1: the last context token); a node sits one
  position after its parent. A chain is the tree with parents ``[-1, 0, 1, ...]``.
- **siblings**: nodes with the same parent, i.e. candidates for the same position.
- **path**: the accepted nodes, root first; its tokens are what the verdict commits before the next
  token.
- Greedy: from the root, take the child whose token is ``argmax p`` at that position; the path ends at
  a node none of whose children is the argmax (the argmax is then the recovered token — recovered
  after all its siblings were rejected) or at a leaf (the argmax is the bonus token). The committed
  tokens are exactly the target's greedy continuation, whatever the tree, since every committed token
  is an argmax of p given the committed tokens before it.
- Sampling (the recursive residual over siblings, SpecInfer's rule with each candidate's own q): at
  a position with candidates c_1 .. c_m (children of the same node, in index order; c_1 usually
  the main chain's draft, the rest deterministic alternatives whose q is the point mass at their
  token), start from r_0 = p. Candidate c_j is accepted with probability min(1, r_{j-1}(c_j) /
  q_j(c_j)) (u keyed by position and rank: ACCEPT for the first, SIBLING_ACCEPT after); if it is
  rejected, r_j = norm(max(0, r_{j-1} - q_j)). Every candidate rejected: the recovered token is
  drawn from r_m (RESIDUAL for m = 1, SIBLING_RESIDUAL after). Each stage is one standard
  speculative step — target r_{j-1}, proposal q_j, candidate c_j drawn from q_j (a point mass is a
  proposal like any other, fixed before the stage's uniform is drawn) — so what it emits is
  distributed as r_{j-1}; by induction from the last stage back, the position's token is
  distributed as p. A chain (m = 1 everywhere) is exactly the rule above. The scheduler sends
  sampled requests as chains all the same: which alternatives a verify carries depends on chunk
  timing, and seeded output must not (module coordinator/scheduling/scheduler.py, `_verify_item`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from duospec.qcodec import DraftProbs
from duospec.trees import chain_parents, tree_children
from duospec.verify.items import check_item
from duospec.sampling import (
    Purpose,
    SamplingParams,
    probs_from_logits,
    sample_target,
    sample_token,
    sibling_key,
    uniform,
)


class NextTokenKind(enum.Enum):
    RECOVERED = "recovered"  # resampled after a rejection (greedy: the target's argmax)
    BONUS = "bonus"  # all drafts accepted; one more token from p
    NONE = "none"  # all drafts accepted and the bonus was declined


@dataclass(frozen=True)
class Verdict:
    n_accepted: int  # draft tokens kept, a prefix of the chunk
    next_token: int | None  # None only with kind NONE
    kind: NextTokenKind

    def __post_init__(self) -> None:
        if (self.next_token is None) != (self.kind is NextTokenKind.NONE):
            raise ValueError(f"Verdict next_token={self.next_token} contradicts kind={self.kind}")


DraftQ = Sequence[DraftProbs] | torch.Tensor | None


def verify(
    draft_tokens: Sequence[int],
    target_logits: torch.Tensor,
    draft_probs: DraftQ,
    params: SamplingParams,
    start_pos: int,
    *,
    sample_bonus: bool = True,
) -> Verdict:
    """Decide how many of ``draft_tokens`` to keep and which token follows them.

    Args:
        draft_tokens: ``[k]`` the drafter's tokens; ``draft_tokens[0]`` sits at ``start_pos``.
        target_logits: ``[k+1, V]``; row ``i`` is the target's prediction for ``start_pos + i``,
            row ``k`` the bonus position.
        draft_probs: q for each draft token, ``k`` ``DraftProbs`` or a ``[k, V]`` tensor. Ignored
            (may be None) when ``params`` is greedy; required otherwise.
        params: the request's sampling parameters, applied identically to p and q.
        start_pos: sequence position of ``draft_tokens[0]``; keys the random draws.
        sample_bonus: if False, an all-accepted chunk yields kind NONE instead of a bonus token.
    """
    k = check_item(draft_tokens, None, params, start_pos, draft_probs)
    _check_logits(target_logits, draft_tokens)
    # The reference runs on the CPU: k+1 rows are cheap to move and numpy does the per-token work
    # (duospec/verify/batch.py decides whole batches on the device with the same arithmetic).
    target_logits = target_logits.detach().cpu()
    tokens = [int(t) for t in draft_tokens]
    if params.greedy:
        _, verdict = _walk_greedy(tokens, chain_parents(k), target_logits, sample_bonus)
        return verdict
    draft_q = _DraftQ(draft_probs, k, target_logits.shape[1])
    # A chain's p rows are read up front, so broken logits in any draft row fail the item whatever
    # the walk would have reached (what the batched rule reproduces).
    p_rows = probs_from_logits(target_logits[:k], params).numpy().astype(np.float64) if k else ()
    _, verdict = _walk_sampled(tokens, chain_parents(k), target_logits, draft_q.row, params, start_pos,
                               sample_bonus, p_rows=p_rows)
    return verdict


def acceptance_probability(p_x: np.ndarray | float, q_x: np.ndarray | float) -> np.ndarray:
    """``min(1, p(x)/q(x))``, elementwise; 0 where ``q(x) = 0`` or ``p(x) = 0``.

    q(x) = 0 means the drafter could not have drawn x, so there is no ratio to test; p(x) = 0 means
    the target (after truncation) never emits x. Both are rejections whatever u is. Exposed, with
    ``residual_distribution``, so the statistical tests can apply the rule to many draws at once.
    """
    p_x = np.asarray(p_x, dtype=np.float64)
    q_x = np.asarray(q_x, dtype=np.float64)
    valid = (p_x > 0.0) & (q_x > 0.0)
    ratio = np.divide(p_x, q_x, out=np.zeros(np.broadcast(p_x, q_x).shape), where=valid)
    return np.minimum(ratio, 1.0)


def residual_distribution(p_row: np.ndarray, q_row: np.ndarray) -> np.ndarray:
    """Unnormalised ``max(0, p - q)`` ``[V]`` float64; p itself when that has no mass.

    The residual is empty only when p == q up to rounding, where a rejection is (almost) never
    drawn and p is the exact answer.
    """
    residual = np.maximum(np.asarray(p_row, np.float64) - np.asarray(q_row, np.float64), 0.0)
    return residual if residual.sum() > 0.0 else np.asarray(p_row, np.float64)


@dataclass(frozen=True)
class TreeVerdict:
    path: tuple[int, ...]  # accepted node indices, root first (a chain: 0 .. n_accepted-1)
    verdict: Verdict  # n_accepted == len(path)


def verify_tree(
    draft_tokens: Sequence[int],
    parents: Sequence[int],
    target_logits: torch.Tensor,
    params: SamplingParams,
    start_pos: int,
    *,
    draft_probs: Sequence | None = None,
    sample_bonus: bool = True,
) -> TreeVerdict:
    """The longest accepted path through a tree of drafts (the rules: module docstring).

    Args:
        draft_tokens: ``[k]`` node tokens; a node sits at ``start_pos + depth - 1`` (roots at start_pos).
        parents: ``[k]`` parent node index, ``-1`` for a root; ``parents[i] < i``.
        target_logits: ``[k+1, V]``; row 0 predicts the roots' position, row ``i + 1`` the position
            after node ``i`` (its children's, or the bonus).
        draft_probs: sampling only: q of the first nodes (DraftProbs or ``[V]`` arrays; typically the
            main chain's); nodes past them are deterministic candidates (q = the point mass).
    """
    k = check_item(draft_tokens, parents, params, start_pos, draft_probs)
    _check_logits(target_logits, draft_tokens)
    tokens, parents = [int(t) for t in draft_tokens], [int(p) for p in parents]
    target_logits = target_logits.detach().cpu()
    if params.greedy:
        path, verdict = _walk_greedy(tokens, parents, target_logits, sample_bonus)
    else:
        vocab = target_logits.shape[1]
        given = list(draft_probs) if draft_probs is not None else []
        path, verdict = _walk_sampled(
            tokens, parents, target_logits,
            lambda node: _dense_q(given[node] if node < len(given) else None, tokens[node], vocab),
            params, start_pos, sample_bonus)
    return TreeVerdict(tuple(path), verdict)


def _walk_sampled(tokens: list[int], parents: list[int], target_logits: torch.Tensor,
                  q_of: Callable[[int], np.ndarray], params: SamplingParams, start_pos: int, sample_bonus: bool,
                  p_rows=None) -> tuple[list[int], Verdict]:
    """The recursive residual over each position's candidates (module docstring); `q_of(node)` is the
    node's q as float64 ``[V]``. With `p_rows` (a chain's rows, read up front) p is used as the softmax
    gave it; a tree's residual is renormalised at each candidate, p's first included."""
    chain = p_rows is not None
    children = tree_children(parents)
    path, node = [], -1
    while True:
        pos = start_pos + len(path)
        options = children.get(node, ())
        if not options:
            if not sample_bonus:
                return path, Verdict(len(path), None, NextTokenKind.NONE)
            return path, Verdict(len(path), sample_target(target_logits[node + 1], params, pos), NextTokenKind.BONUS)
        if chain:
            residual = p_rows[node + 1]
        else:
            residual = probs_from_logits(target_logits[node + 1 : node + 2], params)[0].numpy().astype(np.float64)
        match = None
        for rank, child in enumerate(options):
            x = tokens[child]
            q = q_of(child)
            base = residual if chain else residual / residual.sum()
            a = float(acceptance_probability(base[x], q[x]))
            # Accept iff u < a; with a = 1 that holds for every u in [0, 1), so u is not drawn.
            if a >= 1.0 or a > 0.0 and _accept_u(params.seed, pos, rank) < a:
                match = child
                break
            residual = residual_distribution(base, q)
        if match is None:
            u = uniform(params.seed, pos, Purpose.RESIDUAL) if len(options) == 1 else uniform(
                params.seed, sibling_key(pos, len(options)), Purpose.SIBLING_RESIDUAL)
            return path, Verdict(len(path), sample_token(torch.from_numpy(residual), u), NextTokenKind.RECOVERED)
        path.append(match)
        node = match


def _accept_u(seed: int, pos: int, rank: int) -> float:
    return uniform(seed, pos, Purpose.ACCEPT) if rank == 0 else uniform(seed, sibling_key(pos, rank),
                                                                       Purpose.SIBLING_ACCEPT)


def _dense_q(q, token: int, vocab: int) -> np.ndarray:
    """A candidate's q as float64 [V]: its DraftProbs, or the point mass at its token."""
    if q is None:
        dense = np.zeros(vocab)
        dense[token] = 1.0
        return dense
    if isinstance(q, DraftProbs):
        return q.dense(vocab).numpy().astype(np.float64)
    return np.asarray(q, dtype=np.float64)


def _walk_greedy(tokens: list[int], parents: list[int], target_logits: torch.Tensor,
                 sample_bonus: bool) -> tuple[list[int], Verdict]:
    argmax = target_logits.argmax(dim=-1).tolist()  # argmax[i + 1]: after node i; argmax[0]: the roots'
    children = tree_children(parents)
    path, node = [], -1
    while True:
        want = argmax[node + 1]
        options = children.get(node, ())
        match = next((child for child in options if tokens[child] == want), None)
        if match is None:
            if options:  # every sibling at this position was rejected
                return path, Verdict(len(path), want, NextTokenKind.RECOVERED)
            if not sample_bonus:
                return path, Verdict(len(path), None, NextTokenKind.NONE)
            return path, Verdict(len(path), want, NextTokenKind.BONUS)
        path.append(match)
        node = match


class _DraftQ:
    """q rows as float64 numpy, decoded lazily: only positions up to the first rejection."""

    def __init__(self, draft_probs: DraftQ, k: int, vocab_size: int) -> None:
        self._vocab_size = vocab_size
        if isinstance(draft_probs, torch.Tensor):
            if tuple(draft_probs.shape) != (k, vocab_size):
                raise ValueError(
                    f"draft_probs tensor has shape {tuple(draft_probs.shape)}, expected "
                    f"[k, V] = [{k}, {vocab_size}]"
                )
            self._rows: np.ndarray | Sequence[DraftProbs] = draft_probs.detach().cpu().to(torch.float64).numpy()
        else:  # check_item has made sure of one DraftProbs per draft token
            self._rows = draft_probs or ()

    def row(self, i: int) -> np.ndarray:
        row = self._rows[i]
        if isinstance(row, DraftProbs):
            return row.dense(self._vocab_size).numpy().astype(np.float64)
        return row


def _check_logits(target_logits: torch.Tensor, draft_tokens: Sequence[int]) -> None:
    k = len(draft_tokens)
    if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 2:
        raise ValueError("target_logits must be a 2-D tensor [k+1, V]")
    if target_logits.shape[0] != k + 1:
        raise ValueError(
            f"target_logits has {target_logits.shape[0]} rows for {k} draft tokens; "
            f"expected k+1 = {k + 1} (one per draft position plus the bonus position)"
        )
    vocab = target_logits.shape[1]
    bad = [int(t) for t in draft_tokens if not int(t) < vocab]
    if bad:
        raise ValueError(f"draft_tokens {bad} are outside the target vocabulary [0, {vocab})")
