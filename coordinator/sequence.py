"""Per-sequence state in the coordinator: the one place that knows a sequence's committed tokens,
its epoch, the drafts in flight and how much of each worker's KV cache is valid."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from coordinator.adaptive import AcceptanceTracker
from coordinator.api import FinishReason, GenerationRequest, SpecStats
from coordinator.policies import SpeculationPolicy


@dataclass
class Sequence:
    seq_id: int
    request: GenerationRequest
    policy: SpeculationPolicy
    committed: list[int]  # prompt + generated, all verified
    prompt_len: int
    eos_token_id: int | None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    stats: SpecStats = field(default_factory=SpecStats)
    epoch: int = 0
    # Unverified draft tokens at positions len(committed), len(committed)+1, ...
    drafts: list[int] = field(default_factory=list)
    draft_probs: list[bytes] = field(default_factory=list)  # [len(drafts)] or empty when greedy
    draft_alive: bool = True  # False: the drafter dropped it or died; go on target-only
    draft_fed_len: int = 0  # the drafter's KV cache holds valid tokens for positions < this
    draft_started: bool = False
    target_len: int = 0  # the target's KV cache holds committed[:target_len]
    verifying: int | None = None  # drafts in the in-flight verify batch (None: not in flight)
    round_start: int = 0  # position of the first draft of the current round (after start/abort)
    finish_reason: FinishReason | None = None
    acceptance: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    started_at: float = field(default_factory=time.monotonic)

    @property
    def greedy(self) -> bool:
        return self.request.sampling.greedy

    @property
    def limit(self) -> int:
        """One past the last position this request may commit."""
        return self.prompt_len + self.request.max_new_tokens

    @property
    def remaining(self) -> int:
        return self.limit - len(self.committed)

    @property
    def uses_draft(self) -> bool:
        return self.policy.uses_draft and self.draft_alive

    def draft_until(self) -> int:
        return min(len(self.committed) + self.policy.lookahead(), self.limit)

    def stop_ids(self) -> frozenset[int]:
        ids = self.request.stop_token_ids
        if self.eos_token_id is not None and not self.request.ignore_eos:
            ids = ids | {self.eos_token_id}
        return ids

    def commit(self, tokens: list[int]) -> list[int]:
        """Appends verified tokens, cut at a stop token or the length limit; sets finish_reason."""
        stop_ids = self.stop_ids()
        kept = []
        for token in tokens[: self.remaining]:
            kept.append(token)
            if token in stop_ids:
                is_eos = token == self.eos_token_id and token not in self.request.stop_token_ids
                self.finish_reason = FinishReason.EOS if is_eos else FinishReason.STOP
                break
        self.committed.extend(kept)
        if self.finish_reason is None and self.remaining <= 0:
            self.finish_reason = FinishReason.LENGTH
        return kept

    def drop_drafts(self) -> int:
        n = len(self.drafts)
        self.drafts.clear()
        self.draft_probs.clear()
        return n
