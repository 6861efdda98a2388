"""Sampling parameters, logits → probabilities, and counter-based randomness.

(Foundation file: the rest of this module is filled in by the sampling/verify work.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax of raw logits)
    top_k: int = 0  # 0 = no top-k truncation
    top_p: float = 1.0  # 1.0 = no nucleus truncation
    seed: int = 0  # keys every random draw: (seed, position, purpose)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
