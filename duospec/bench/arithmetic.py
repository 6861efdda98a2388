"""The numbers a benchmark report is made of, as pure functions over measured timings.

Glossary (the same words in the report, docs/benchmarks.md and the JSON keys):

- tokens/s: generated tokens divided by the wall time of the requests that produced them.
- speedup(x, base): tokens/s of x over tokens/s of base (> 1 = x is faster).
- mean accepted length: committed tokens per target forward, accepted drafts + 1 (SpecStats).
- ideal overlap bound: what pearl would reach if the target never idled and nothing but its verify
  forwards took time: mean accepted length / seconds of one verify forward.
- efficiency: measured tokens/s over the ideal bound.
- busy fraction: seconds an actor reported working over the wall time of the window.
- overhead per round: wall time of a verify round minus the target's own time for it (its forward
  and the verify rule), i.e. what the coordinator, the links and the event loop add.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence


def _finite(values: Iterable[float], what: str) -> list[float]:
    out = [float(v) for v in values]
    if not out:
        raise ValueError(f"{what}: no values (the benchmark measured nothing; check --repeats and the prompt set)")
    bad = next((v for v in out if not math.isfinite(v)), None)
    if bad is not None:
        raise ValueError(f"{what}: {bad} is not a finite number")
    return out


def median(values: Iterable[float]) -> float:
    ordered = sorted(_finite(values, "median"))
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the two nearest ranks (numpy's default)."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q={q} must be within [0, 100]")
    ordered = sorted(_finite(values, "percentile"))
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def tokens_per_second(tokens: int, seconds: float) -> float:
    if seconds <= 0:
        raise ValueError(f"tokens_per_second: wall time {seconds} s must be positive")
    return tokens / seconds


def all_live_tokens_per_s(arrivals: Iterable[tuple[float, int]], started: float, stream_ends: list[float]) -> float:
    """Aggregate tokens/s of a concurrency pass until its first stream finished, i.e. while every
    stream was live. `arrivals`: (time, tokens) of each streamed chunk. Streams that advance at
    different speeds (speculation accepts more on some prompts) leave the pass a tail with fewer live
    streams, where batching gains less; this measure leaves that tail out."""
    first_end = min(stream_ends)
    return tokens_per_second(sum(n for t, n in arrivals if t <= first_end), first_end - started)


def tail_share(started: float, stream_ends: list[float]) -> float:
    """Share of a concurrency pass's wall time after its first stream finished."""
    return (max(stream_ends) - min(stream_ends)) / (max(stream_ends) - started)


def speedup(tokens_per_s: float, baseline_tokens_per_s: float) -> float:
    if baseline_tokens_per_s <= 0:
        raise ValueError(f"speedup: baseline {baseline_tokens_per_s} tokens/s must be positive")
    return tokens_per_s / baseline_tokens_per_s


def ideal_overlap_tokens_per_s(tokens_per_forward: float, verify_forward_s: float) -> float:
    """Upper bound with perfect overlap: the target verifies back to back and each forward commits
    `tokens_per_forward` tokens."""
    if verify_forward_s <= 0:
        raise ValueError(f"ideal bound: verify forward time {verify_forward_s} s must be positive")
    return tokens_per_forward / verify_forward_s


def efficiency(measured_tokens_per_s: float, ideal_tokens_per_s: float) -> float:
    if ideal_tokens_per_s <= 0:
        raise ValueError(f"efficiency: ideal {ideal_tokens_per_s} tokens/s must be positive")
    return measured_tokens_per_s / ideal_tokens_per_s


def busy_fraction(busy_s: float, wall_s: float) -> float:
    if wall_s <= 0:
        raise ValueError(f"busy fraction: window of {wall_s} s must be positive")
    return busy_s / wall_s


def overhead_per_round_s(wall_s: float, target_busy_s: float, rounds: int) -> float:
    """(wall − target's own time) / verify rounds, for requests run one at a time in target-only mode
    (there every round's sequence is ready at once, so no time is genuine waiting for drafts)."""
    if rounds <= 0:
        raise ValueError("overhead per round: no verify rounds were measured")
    return (wall_s - target_busy_s) / rounds


def accepted_length_histogram(accepted_per_pos: Sequence[int], verify_rounds: int) -> list[int]:
    """Rounds by number of accepted drafts: out[n] = rounds that accepted exactly n drafts.

    accepted_per_pos[i] counts rounds whose draft at offset i was accepted, i.e. rounds that accepted
    at least i + 1 (acceptance is a prefix), so exact counts are differences of neighbours."""
    at_least = [verify_rounds, *accepted_per_pos, 0]
    if any(a < b for a, b in zip(at_least, at_least[1:])):
        raise ValueError(f"accepted_per_pos {list(accepted_per_pos)} is not non-increasing within {verify_rounds} rounds")
    return [at_least[n] - at_least[n + 1] for n in range(len(accepted_per_pos) + 1)]


def ratio_or_none(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator when both were measured (a mode may have been skipped)."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator
