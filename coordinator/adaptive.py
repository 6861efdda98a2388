"""Adaptive draft length: how many draft tokens to verify per sequence, from measured costs.

Two measurements, both taken from messages the scheduler already receives (no extra round trips):

- the target's verify cost as a function of the tokens in a batch, fitted online as
  t(n) = fixed + per_token · n (an exponentially weighted least-squares line), and
- each sequence's per-token acceptance rate α (an exponentially weighted count of accepted vs
  rejected draft tokens).

With k draft tokens a sequence commits E(k) = (1 − α^(k+1)) / (1 − α) tokens per verify (accepted
run + the recovered/bonus token). The scheduler picks the k that maximises committed tokens per
second of target time for the whole batch:

    throughput(k) = Σ_seq E_seq(k) / t(Σ_seq (k + 1))

When the batch is small, t is dominated by `fixed` and longer drafts pay; when the batch is large the
per-token term dominates, E(k)/(k+1) < 1 decides, and k backs off toward 0 (target-only, `off`).
In vanilla mode the drafter's own time (k draft steps, not overlapped) is added to the round.
"""

from __future__ import annotations

from dataclasses import dataclass


def expected_tokens(alpha: float, k: int) -> float:
    """Committed tokens per verify with k drafts and per-token acceptance alpha (i.i.d. model)."""
    if k <= 0:
        return 1.0
    alpha = min(max(alpha, 0.0), 0.999)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class VerifyCostModel:
    """t(n) = fixed + per_token · n seconds, fitted by exponentially weighted least squares."""

    decay: float = 0.95
    _w: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0

    def observe(self, n_tokens: int, seconds: float) -> None:
        if n_tokens <= 0 or seconds <= 0:
            return
        d = self.decay
        self._w = d * self._w + 1.0
        self._sx = d * self._sx + n_tokens
        self._sy = d * self._sy + seconds
        self._sxx = d * self._sxx + n_tokens * n_tokens
        self._sxy = d * self._sxy + n_tokens * seconds

    @property
    def ready(self) -> bool:
        return self._w >= 4.0

    def coefficients(self) -> tuple[float, float]:
        """(fixed, per_token); per_token is clamped at >= 0, fixed at >= 0."""
        if self._w == 0:
            return 0.0, 0.0
        mean_x, mean_y = self._sx / self._w, self._sy / self._w
        var_x = self._sxx / self._w - mean_x * mean_x
        if var_x <= 1e-9:  # every batch had the same size: no slope information yet
            return mean_y, 0.0
        slope = max(0.0, (self._sxy / self._w - mean_x * mean_y) / var_x)
        return max(0.0, mean_y - slope * mean_x), slope

    def cost(self, n_tokens: int) -> float:
        fixed, per_token = self.coefficients()
        return fixed + per_token * n_tokens


@dataclass
class AcceptanceTracker:
    """Per-sequence acceptance rate, exponentially weighted over verify rounds."""

    decay: float = 0.8
    accepted: float = 2.0  # a mildly optimistic prior: start by speculating
    rejected: float = 1.0

    @classmethod
    def with_prior(cls, alpha: float, weight: float = 3.0) -> "AcceptanceTracker":
        """A tracker starting at `alpha`, held with the weight of the default prior."""
        alpha = min(max(alpha, 0.0), 1.0)
        return cls(accepted=weight * alpha, rejected=weight * (1.0 - alpha))

    def observe(self, n_accepted: int, n_rejected: int) -> None:
        self.accepted = self.decay * self.accepted + n_accepted
        self.rejected = self.decay * self.rejected + n_rejected

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


def best_draft_length(
    alphas: list[float],
    cost: VerifyCostModel,
    max_k: int,
    *,
    min_k: int = 0,
    draft_step_s: float = 0.0,
) -> int:
    """The batch-wide k in [min_k, max_k] that maximises committed tokens per second.

    `draft_step_s` > 0 adds k non-overlapped draft steps to each round (vanilla). Until the cost
    model has data, returns max_k (speculate; the measurements come from doing it).
    """
    if not alphas or not cost.ready:
        return max_k
    best_k, best_rate = max_k, -1.0
    for k in range(min_k, max_k + 1):
        committed = sum(expected_tokens(a, k) for a in alphas)
        seconds = cost.cost(len(alphas) * (k + 1)) + k * draft_step_s
        rate = committed / seconds if seconds > 0 else committed
        if rate > best_rate * (1 + 1e-6):  # ties go to the shorter draft (less wasted work)
            best_k, best_rate = k, rate
    return best_k


@dataclass
class Ewma:
    """An exponentially weighted mean (None until the first observation)."""

    decay: float = 0.9
    value: float | None = None

    def observe(self, x: float) -> None:
        self.value = x if self.value is None else self.decay * self.value + (1 - self.decay) * x


def drafts_worth_waiting_for(alpha: float, n_ready: int, max_k: int, cost: VerifyCostModel, draft_step_s: float,
                             round_overhead_s: float = 0.0, context_tokens: int = 1) -> int:
    """How many drafts (>= n_ready, <= max_k) to verify for the most committed tokens per second when
    the target is free now and n_ready drafts are there: rate(k) = E(k) / (round(k) + (k − n)·step),
    round(k) = t(context + k) + overhead. Returns n_ready when sending now is best (or unmeasured)."""
    if n_ready >= max_k or draft_step_s <= 0 or not cost.ready:
        return n_ready

    def rate(k: int) -> float:
        seconds = cost.cost(context_tokens + k) + round_overhead_s + (k - n_ready) * draft_step_s
        return expected_tokens(alpha, k) / seconds if seconds > 0 else float("inf")

    best_k, best_rate = n_ready, rate(n_ready)
    for k in range(n_ready + 1, max_k + 1):
        r = rate(k)
        if r > best_rate * 1.02:  # a wait must pay clearly: it is a bet on α and the step time
            best_k, best_rate = k, r
    return best_k
