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
                             round_overhead_s: float = 0.0, context_tokens: int = 1,
                             first_draft_s: float | None = None) -> int:
    """How many drafts (n_ready..max_k) to verify for the most committed tokens per second when the
    target is free now and n_ready drafts are there (0 right after a rejection). Returns n_ready when
    going now is best, or when the costs are unmeasured (then at least 1: without `first_draft_s`,
    how long a restarted drafter takes to deliver its first draft, an empty round is never chosen).

    The drafter keeps drafting while the target verifies, so a round is valued by what it leaves the
    next one too, as a step of a two-state average-reward process (PipelineRounds): waiting for k
    drafts scores E(k) − g·T(k) + P_F(k)·h_F, where T(k) is the wait plus the round, g the best
    long-run rate, P_F(k) the chance that the next round finds a full chunk ready and h_F what that
    is worth. A one-round rate E(k)/T(k) undervalues going now: it counts the drafts made during the
    round as lost, though a round accepted whole (and its bonus guessed) finds them ready."""
    if n_ready >= max_k:
        return n_ready
    if draft_step_s <= 0 or not cost.ready or (n_ready == 0 and first_draft_s is None):
        return max(n_ready, 1)
    rounds = PipelineRounds(alpha, max_k, cost, draft_step_s, round_overhead_s, context_tokens, first_draft_s)
    scores = {k: rounds.score(k, n_ready) for k in range(n_ready, max_k + 1)}
    best_k = max(scores, key=scores.get)
    # A wait must pay clearly (2 % of a round's tokens): it is a bet on α and the step times.
    return best_k if scores[best_k] > scores[n_ready] + 0.02 * expected_tokens(alpha, n_ready) else n_ready


def wait_for_drafts_s(k: int, ready: int, draft_step_s: float, first_draft_s: float | None) -> float:
    """Expected seconds until k drafts are there with `ready` there now: none when k <= ready; right
    after a restart (ready = 0) the first comes after `first_draft_s` (a step when unmeasured), then one
    every `draft_step_s`."""
    if k <= ready:
        return 0.0
    if ready == 0:
        return (first_draft_s if first_draft_s is not None else draft_step_s) + (k - 1) * draft_step_s
    return (k - ready) * draft_step_s


@dataclass
class PipelineRounds:
    """Pearl's verify rounds as a two-state average-reward process (drafts_worth_waiting_for).

    State F: the round starts with a full chunk (`full` drafts) ready. State M: it starts right after
    a rejection, with no draft; the restarted drafter's first comes `first_draft_s` later, then one
    every `draft_step_s`. A round that verifies k drafts commits E(k) tokens in T(k) = wait +
    t(context + k) + overhead. The next round starts in F when this one is accepted whole and its
    bonus is what the drafter drafted next (together α^(k+1), i.i.d. acceptance), else in M. F
    assumes the drafter keeps ahead of the target (a draft step well under a verify, as a draft
    model's is): a chunk still on its way when the round ends is not lost, only later (the scheduler
    checks it against the tokens decided meanwhile: Sequence.decided_prefix). In M the process takes
    the k0 that maximises its long-run rate g — k0 = 0, an empty round, only when `first_draft_s` is
    known (the scheduler runs none before); `score` is a round's value relative to that process
    (h_M = 0)."""

    alpha: float
    full: int
    cost: VerifyCostModel
    draft_step_s: float
    round_overhead_s: float
    context_tokens: int
    first_draft_s: float | None

    def __post_init__(self) -> None:
        self.alpha = min(max(self.alpha, 0.0), 0.999)
        self._line = self.cost.coefficients()  # (fixed, per_token): fitted once, not per round evaluated
        e_f, t_f, p_f = self._round(self.full, self.full)
        first_k0 = 0 if self.first_draft_s is not None else 1
        self.rate = max(self._rate(k0, e_f, t_f, p_f) for k0 in range(first_k0, self.full + 1))  # g
        self.value_full = (e_f - self.rate * t_f) / (1.0 - p_f)  # h_F

    def _round(self, k: int, ready: int) -> tuple[float, float, float]:
        """(tokens committed, seconds, probability the next round starts in F) of a round that waits
        for k drafts with `ready` there (ready = 0: right after the drafter's restart)."""
        wait = wait_for_drafts_s(k, ready, self.draft_step_s, self.first_draft_s)
        fixed, per_token = self._line
        seconds = wait + fixed + per_token * (self.context_tokens + k) + self.round_overhead_s
        return expected_tokens(self.alpha, k), seconds, self.alpha ** (k + 1)

    def _rate(self, k0: int, e_f: float, t_f: float, p_f: float) -> float:
        """Long-run committed tokens per second when M takes k0 and F a full chunk: per visit to M,
        p_M / (1 − p_F) visits to F."""
        e_m, t_m, p_m = self._round(k0, 0)
        f_per_m = p_m / (1.0 - p_f)
        seconds = t_m + f_per_m * t_f
        return (e_m + f_per_m * e_f) / seconds if seconds > 0 else float("inf")

    def score(self, k: int, ready: int) -> float:
        """A round waiting for k drafts with `ready` there: its tokens, less what its time would earn
        at the long-run rate, plus the worth of starting the next round with a full chunk."""
        tokens, seconds, p_full = self._round(k, ready)
        return tokens - self.rate * seconds + p_full * self.value_full
