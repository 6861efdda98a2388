"""Speculation policies: one scheduler loop, three strategies (STYLE.md §5).

A policy answers three questions for a sequence: how far the drafter may run ahead of the committed
prefix, when the sequence is ready to go into a verify batch, and how many draft tokens to verify.
"""

from __future__ import annotations

from dataclasses import dataclass

from duospec.coordinator.api import SpeculationMode
from duospec.internal.v1 import pearl_pb2 as pb


@dataclass(frozen=True)
class SpeculationPolicy:
    mode: SpeculationMode
    max_draft_tokens: int  # pearl: most drafts per verify; vanilla: γ
    max_lookahead: int  # pearl: how far the drafter may run past the committed prefix
    adaptive: bool = True  # pearl: the scheduler may verify fewer drafts (coordinator/scheduling/adaptive.py)
    hedges: int = 0  # pearl: the speculation cache's hedges per sequence (0 = no cache)
    tree_nodes: int = 0  # pearl, greedy: hedge tokens verified as a token tree next to the chain (0 = none)
    lookup: bool = False  # pearl, greedy: rounds without a draft verify tokens found in the sequence's own text

    def max_hedges(self) -> int:
        """Hedges the drafter may hold for a sequence: pearl only (vanilla stays the textbook chain)."""
        return self.hedges if self.mode is SpeculationMode.PEARL else 0

    def hedges_now(self, acceptance: float, paused: bool) -> int:
        """Hedges for a sequence whose acceptance estimate is `acceptance` (none while its drafting is
        `paused`). They pay only on a rejection but cost draft steps always: adaptive pearl keeps
        2·(1 - α) of the configured number (at least one)."""
        n = 0 if paused else self.max_hedges()
        if n and self.adaptive_pearl:
            n = min(n, max(1, round(2 * n * (1 - acceptance))))
        return n

    @property
    def uses_draft(self) -> bool:
        return self.mode is not SpeculationMode.OFF

    @property
    def adaptive_pearl(self) -> bool:
        """Whether the scheduler adapts this policy's speculation as it goes: the draft length
        (coordinator/scheduling/adaptive.py), patience (patience.py), and for greedy requests the goodput guard
        (guard.py). Vanilla is the fixed baseline; a non-adaptive pearl policy keeps its settings."""
        return self.adaptive and self.mode is SpeculationMode.PEARL

    def guarded(self, greedy: bool) -> bool:
        """Whether the goodput guard may switch speculation off for a request (greedy adaptive pearl;
        coordinator/scheduling/guard.py says why sampled requests are not)."""
        return self.adaptive_pearl and greedy

    def draft_limit(self, greedy: bool, speculating: bool, adapted_length: int | None) -> int:
        """Most drafts to verify now: the cap, lowered in adaptive pearl by the measured best length
        (`adapted_length`, None until measured), and 0 for a guarded request while the guard has
        speculation off (`speculating`). Sampling keeps k >= 1: a timing-dependent switch to the
        bonus rule would change seeded output."""
        limit = self.max_draft_tokens
        if self.adaptive_pearl:
            if greedy and not speculating:
                return 0
            if adapted_length is not None:
                limit = min(limit, max(adapted_length, 0 if greedy else 1))
        return limit

    def lookahead(self) -> int:
        """Draft positions allowed past the committed prefix. Pearl: at least 2γ + 1, so that while
        the target verifies γ drafts the drafter can finish the next γ past the bonus position, and a
        fully accepted round is followed by a full chunk at once — but never more than γ past the
        configured lookahead (a request asking for a large γ must not multiply wasted drafting)."""
        if self.mode is SpeculationMode.PEARL:
            floor = min(2 * self.max_draft_tokens + 1, self.max_lookahead + self.max_draft_tokens)
            return max(self.max_lookahead, floor)
        if self.mode is SpeculationMode.VANILLA:
            return self.max_draft_tokens  # the drafter stops at γ and idles until the verdict
        return 0

    def ready(self, n_drafts: int, remaining: int, draft_alive: bool, prefill_pending: bool = False,
              free: int = 0) -> bool:
        """Whether a sequence with `n_drafts` unverified drafts (`free` of them grammar-forced, which
        the cap does not count) should go to the target now. `prefill_pending`: the target has not
        seen the prompt yet."""
        if not (self.uses_draft and draft_alive):
            return True
        if self.mode is SpeculationMode.PEARL:
            # pre-verify: one token is enough when the target is free; and the target prefills the
            # prompt at once, while the drafter prefills and drafts its first token.
            return n_drafts >= 1 or prefill_pending
        return n_drafts - free >= min(self.max_draft_tokens, remaining - free)  # vanilla: a full γ chunk

    def bonus(self, greedy: bool, drafting: bool) -> int:
        # Pearl with sampling declines the bonus: whether a position is decided by the bonus rule or
        # the accept/reject rule would otherwise depend on chunk timing, and seeded output must not.
        # Without a drafter (it died) the bonus is the only way forward.
        if self.mode is SpeculationMode.PEARL and not greedy and drafting:
            return pb.BONUS_POLICY_SKIP
        return pb.BONUS_POLICY_SAMPLE


def fair_share(ready: list, vtime: dict[str, float], limit: int) -> list:
    """Which of the `ready` sequences go into a verify batch of at most `limit`: weighted fair share
    of the target by tenant (`vtime`: target rows / weight so far), oldest first within a tenant."""
    if len(ready) <= limit:
        return ready
    vtime = dict(vtime)
    chosen: list = []
    pool = sorted(ready, key=lambda s: s.started_at)
    while pool and len(chosen) < limit:
        seq = min(pool, key=lambda s: vtime.get(s.request.tenant, 0.0))
        pool.remove(seq)
        chosen.append(seq)
        # Charge the rows its item will likely take provisionally, so one tenant can't take the whole
        # batch with expensive items (the scheduler charges the real rows once the items are built).
        vtime[seq.request.tenant] = vtime.get(seq.request.tenant, 0.0) + _rows_estimate(seq) / seq.request.priority_weight
    return chosen


def _rows_estimate(seq) -> int:
    """The target rows `seq`'s next verify item will likely take: the context it has not fed yet (1
    while decoding, a prompt chunk's worth while prefilling) and the drafts it may verify."""
    pending = max(1, len(seq.committed) - seq.target_len)
    return pending + min(len(seq.drafts), seq.policy.max_draft_tokens)
