"""Sampling parameters, logits → probabilities, and counter-based randomness.

Every random draw in duospec is keyed by ``(request seed, position, purpose)`` (docs/design.md#exactness),
never by a stateful generator: the drafter and the target live in different processes and verify
chunks of whatever size happens to be ready, so a draw must not depend on how many came before it.
``uniform`` is therefore a pure hash of its three arguments.

Both sides turn logits into probabilities with the same ``probs_from_logits`` (temperature, then
top-k, then top-p, renormalised), so p and q are processed identically before the verify rule.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np
import torch

_U64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64 increment: 2**64 / golden ratio
_INV_2_53 = 1.0 / (1 << 53)


# Sampling parameters cross process boundaries as float32 / uint32 (proto/duospec/internal/v1), and
# logits / temperature overflows for tiny temperatures: these bounds keep every value representable.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 1e4
MAX_TOP_K = 2**31 - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax of raw logits)
    top_k: int = 0  # 0 = no top-k truncation
    top_p: float = 1.0  # 1.0 = no nucleus truncation
    seed: int = 0  # keys every random draw: (seed, position, purpose)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the first bad field and the accepted range."""
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(
                f"sampling.temperature={t!r} is invalid: use a finite number >= 0 (0 = greedy)"
            )
        if t != 0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
            raise ValueError(
                f"sampling.temperature={t!r} is invalid: use 0 (greedy) or a value in "
                f"[{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(
                f"sampling.top_k={self.top_k!r} is invalid: use an integer in [0, 2**31) (0 = no top-k)"
            )
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(
                f"sampling.top_p={p!r} is invalid: use a number in (0, 1] (1 = no nucleus cut)"
            )
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not (0 <= self.seed <= _U64)
        ):
            raise ValueError(
                f"sampling.seed={self.seed!r} is invalid: use an integer in [0, 2**64)"
            )


class Purpose(enum.IntEnum):
    """Why a uniform is drawn; part of the key so the draws for one position never collide."""

    DRAFT = 1  # the drafter samples its token from q
    ACCEPT = 2  # the verifier's accept test u < p(x)/q(x)
    RESIDUAL = 3  # the recovered token from norm(max(0, p - q))
    TARGET = 4  # bonus token, or any target-only draw (mode "off")
    SIBLING_ACCEPT = 5  # token trees: the accept test of a position's j-th candidate, j >= 1
    SIBLING_RESIDUAL = 6  # token trees: the recovered token after j >= 2 candidates were rejected


def sibling_key(position: int, rank: int) -> int:
    """The position key of a token tree's rank-th candidate at `position` (rank < 64): distinct
    from every other position's and rank's, so its draws are independent of all others."""
    return (position << 6) | rank


def _mix64(x):
    # splitmix64 finaliser: a bijection on 64-bit ints with full avalanche. Written once for both
    # Python ints (masked) and numpy uint64 arrays (wrap natively), so the two paths cannot drift.
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _U64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _U64
    return x ^ (x >> 31)


def _key_hash(seed, position: int, purpose: Purpose):
    # Each key part is folded in through its own round (seed, then position, then purpose), so
    # neighbouring seeds or positions give unrelated values.
    h = _mix64((seed + _GOLDEN) & _U64)
    h = _mix64(((h ^ position) + _GOLDEN) & _U64)
    return _mix64(((h ^ int(Purpose(purpose))) + _GOLDEN) & _U64)


def _check_key(position: int) -> None:
    if not 0 <= position <= _U64:
        raise ValueError(f"position={position} is out of range: use an integer >= 0")


def uniform(seed: int, position: int, purpose: Purpose) -> float:
    """A uniform float in [0, 1) that depends only on ``(seed, position, purpose)``.

    53 bits of a splitmix64-style hash of the key, the resolution of a double.
    """
    if not 0 <= seed <= _U64:
        raise ValueError(f"seed={seed} is out of range: use an integer in [0, 2**64)")
    _check_key(position)
    return (_key_hash(seed, position, purpose) >> 11) * _INV_2_53


def uniforms(seeds: np.ndarray, positions: np.ndarray | int, purpose: Purpose) -> np.ndarray:
    """``uniform`` for many keys at once: seeds and positions broadcast against each other (an int
    position for all seeds, or an array); float64, bit-identical to the scalar calls."""
    seeds = np.asarray(seeds)
    if seeds.dtype.kind not in "iu" or (seeds.dtype.kind == "i" and (seeds < 0).any()):
        raise ValueError("seeds must be an array of non-negative integers")
    if isinstance(positions, (int, np.integer)):
        _check_key(int(positions))
        keys = int(positions)
    else:
        keys = np.asarray(positions)
        if keys.dtype.kind not in "iu" or (keys.dtype.kind == "i" and (keys < 0).any()):
            raise ValueError("positions must be non-negative integers")
        keys = keys.astype(np.uint64)
    h = _key_hash(seeds.astype(np.uint64), keys, purpose)
    return (h >> 11).astype(np.float64) * _INV_2_53


def _check_logits(logits: torch.Tensor, name: str) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[1] == 0:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"{name} must be a 2-D tensor [n, vocab] with vocab > 0, got {shape}")
    if not logits.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {logits.dtype}")


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits [n, V]`` → probabilities ``[n, V]`` float32 under ``params``.

    Order: temperature, then top-k (ties at the k-th value are all kept), then top-p on the
    renormalised top-k distribution (the smallest prefix of the sorted tokens whose mass reaches
    top_p; the most likely token is always kept), then renormalise. Greedy params give the one-hot
    argmax (lowest index on ties). Each row is computed independently of the other rows.
    """
    params.validate()
    _check_logits(logits, "logits")
    logits = logits.detach().to(torch.float32)
    if torch.isnan(logits).any():
        raise ValueError("logits contain NaN; the model output is broken")
    if (logits == float("-inf")).all(dim=-1).any():
        raise ValueError("a logits row is entirely -inf: no token can be sampled")
    if params.greedy:
        onehot = torch.zeros_like(logits)
        onehot.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return onehot
    n = logits.shape[0]
    return probs_from_logits_rows(logits, torch.full((n,), params.temperature, dtype=torch.float64),
                                  torch.full((n,), params.top_k, dtype=torch.long),
                                  torch.full((n,), params.top_p, dtype=torch.float64))


def probs_from_logits_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                           top_p: torch.Tensor) -> torch.Tensor:
    """`probs_from_logits` for sampled rows each with its own parameters, ``[R]`` tensors on the
    logits' device: float32 ``[R, V]``, each row computed as `probs_from_logits` computes it (each step
    applies only to the rows that ask for it). The batched verify rule calls it for a whole batch."""
    logits = logits.to(torch.float32)
    # Shift before dividing: with a tiny temperature, logits / t overflows to inf and inf - inf is NaN;
    # (logits - max) / t stays in [-inf, 0] and the softmax is the same distribution.
    scaled = (logits - logits.max(dim=-1, keepdim=True).values) / temperature.to(torch.float32)[:, None]
    vocab = scaled.shape[1]
    cut = (top_k > 0) & (top_k < vocab)
    if bool(cut.any()):  # ties at the k-th value are all kept
        rows = cut.nonzero()[:, 0]
        part = scaled[rows]
        kth = torch.sort(part, dim=-1, descending=True).values.gather(1, (top_k[rows] - 1)[:, None])
        scaled[rows] = part.masked_fill(part < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    nucleus = top_p < 1.0
    if bool(nucleus.any()):  # the smallest prefix of the sorted tokens whose mass reaches top_p
        rows = nucleus.nonzero()[:, 0]
        part = probs[rows]
        sorted_probs, order = torch.sort(part, dim=-1, descending=True, stable=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[rows].to(torch.float32)[:, None], 0.0)
        kept = torch.zeros_like(part).scatter_(1, order, sorted_probs)
        probs[rows] = kept / kept.sum(dim=-1, keepdim=True)
    return probs


def logprobs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits [n, V]`` → the log-probabilities a user is shown, ``[n, V]`` float32.

    Sampled params: log of exactly the distribution ``probs_from_logits`` gives (what the verify
    rule draws from; tokens that top-k / top-p remove are -inf). Greedy params: the model's own
    log-softmax (the one-hot argmax would say only 0 and -inf).
    """
    if params.greedy:
        params.validate()
        _check_logits(logits, "logits")
        return torch.log_softmax(logits.detach().to(torch.float32), dim=-1)
    return torch.log(probs_from_logits(logits, params))


def sample_token(probs_row: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample of ``probs_row [V]`` (need not be normalised) with the uniform ``u``."""
    if not 0.0 <= u < 1.0:
        raise ValueError(f"u={u!r} must be in [0, 1)")
    return int(sample_tokens(probs_row, np.array([u], dtype=np.float64))[0])


def sample_tokens(probs_row: torch.Tensor | np.ndarray, us: np.ndarray) -> np.ndarray:
    """``sample_token`` for many uniforms ``us [n]`` against one row: ``[n]`` int64 token ids.

    Works in float64 and scales each u by the row's total, so rows that sum to 1 ± rounding are
    fine. Never returns a zero-probability token: the search lands on the first token whose
    cumulative mass exceeds ``u * total`` (a zero entry never raises the cumulative sum), and
    where rounding pushes past the end, the last token with positive mass is taken.
    """
    if isinstance(probs_row, torch.Tensor):
        probs_row = probs_row.detach().cpu().to(torch.float64).numpy()
    row = np.asarray(probs_row, dtype=np.float64)
    if row.ndim != 1 or row.size == 0:
        raise ValueError(f"probs_row must be a non-empty 1-D row [vocab], got shape {row.shape}")
    if not (np.isfinite(row).all() and (row >= 0).all()):
        raise ValueError("probs_row must hold finite, non-negative probabilities")
    us = np.asarray(us, dtype=np.float64)
    if us.size and not ((us >= 0.0).all() and (us < 1.0).all()):
        raise ValueError("every uniform must be in [0, 1)")
    cdf = np.cumsum(row)
    total = cdf[-1]
    if total <= 0.0:
        raise ValueError("probs_row has no positive mass: nothing can be sampled")
    index = np.searchsorted(cdf, us * total, side="right")
    last_positive = int(np.flatnonzero(row > 0.0)[-1])
    overshoot = index > last_positive
    return np.where(overshoot, last_positive, index).astype(np.int64)


def sample_target(logits_row: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The target's own draw at ``position``: greedy argmax, else p with the TARGET uniform."""
    if not isinstance(logits_row, torch.Tensor) or logits_row.dim() != 1:
        raise ValueError("logits_row must be a 1-D tensor [vocab]")
    if params.greedy:
        params.validate()
        return int(torch.argmax(logits_row))
    probs = probs_from_logits(logits_row.unsqueeze(0), params)[0]
    return sample_token(probs, uniform(params.seed, position, Purpose.TARGET))
