"""What one benchmark run records, and how repeats are summarised.

A *run* is one pass of one mode over the whole prompt set, requests one after another (or, in the
concurrency sweep, several streams at once). Runs are repeated; the report gives medians.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from duospec.bench import arithmetic as ar

# The ablation of the speculation cache (draft_worker/hedges.py): pearl-nocache has neither cache nor
# tree, pearl-notree the cache without token trees, pearl the model's defaults (both on).
OUR_MODES = ("off", "vanilla", "pearl-nocache", "pearl-notree", "pearl")
HF_MODES = ("hf", "hf-assisted")  # transformers generate: target alone / with assistant_model=draft
# `off` with the target's forward on two torch threads: the fair baseline on the same hardware, since
# pearl's two models take one thread (one core) each. In-process only: the server's actors keep one.
OFF_TWO_THREADS = "off-2threads"
OFF_THREADS = 2
ALL_MODES = ("off", OFF_TWO_THREADS, "hf", "hf-assisted", "vanilla", "pearl-nocache", "pearl-notree", "pearl")


def request_mode(mode: str) -> tuple[str, bool | None, bool | None]:
    """A bench mode as the request's (speculation mode, cache, tree); None = the model's default."""
    return {"pearl-nocache": ("pearl", False, False), "pearl-notree": ("pearl", True, False),
            OFF_TWO_THREADS: ("off", None, None)}.get(mode, (mode, None, None))


@dataclass
class RequestRecord:
    prompt_id: str
    token_ids: list[int]
    wall_s: float  # request sent -> last token received
    first_token_s: float | None = None  # request sent -> first token received (None: not streamed)
    # [tokens generated] seconds attributed to each token after the first (chunk gap / chunk size)
    inter_token_s: list[float] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    target_forwards: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    cache_lookups: int = 0
    cache_hits: int = 0
    tree_nodes: int = 0
    tree_hits: int = 0
    lookup_tokens: int = 0
    lookup_accepted: int = 0
    hedge_tokens_kept: int = 0
    # (time.perf_counter() when a streamed chunk came, its tokens): what the sweep's concurrency measures need
    arrivals: list[tuple[float, int]] = field(default_factory=list)

    @classmethod
    def streamed(cls, prompt_id: str, token_ids: list[int], started: float, ended: float,
                 arrivals: list[tuple[float, int]]) -> "RequestRecord":
        """A request's record from when its chunks came: the first token's time from the first chunk,
        and each later chunk's gap shared evenly by its tokens."""
        gaps: list[float] = []
        for (before, _), (at, n) in zip(arrivals, arrivals[1:]):
            gaps.extend([(at - before) / n] * n)
        first = arrivals[0][0] - started if arrivals else None
        return cls(prompt_id, token_ids, ended - started, first, gaps, arrivals=arrivals)

    def take_counts(self, stats) -> None:
        """The request's speculation counts from its final stats: the coordinator's SpecStats (in-process)
        or the SDK's SpeculationStats (through the server; it carries no per-position counts)."""
        self.drafted, self.accepted, self.target_forwards = (stats.drafted_tokens, stats.accepted_tokens,
                                                             stats.target_forwards)
        for name in _COUNTS:
            setattr(self, name, getattr(stats, name))
        self.accepted_per_pos = list(getattr(stats, "accepted_per_pos", ()))


# counts that keep their names from SpecStats / SpeculationStats to RequestRecord
_COUNTS = ("cache_lookups", "cache_hits", "tree_nodes", "tree_hits", "lookup_tokens", "lookup_accepted",
           "hedge_tokens_kept")


@dataclass
class WorkerWindow:
    """Differences of `coordinator.stats()` over a run's window (seconds as the actors report them)."""

    target_busy_s: float = 0.0
    target_rounds: int = 0
    verdict_handling_s: float = 0.0  # the coordinator's own time on the target's verdicts
    draft_busy_s: float = 0.0
    # the goodput guard's verify rounds (coordinator/scheduling/guard.py), and those of them that verified drafts
    guard_rounds: int = 0
    guard_drafted_rounds: int = 0

    @property
    def speculated_share(self) -> float | None:
        return self.guard_drafted_rounds / self.guard_rounds if self.guard_rounds else None


@dataclass
class Run:
    mode: str
    path: str  # "in-process" | "server"
    wall_s: float
    records: list[RequestRecord]
    workers: WorkerWindow | None = None  # None for transformers runs (no actors)

    @property
    def tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.records)

    @property
    def tokens_per_s(self) -> float:
        return ar.tokens_per_second(self.tokens, self.wall_s)

    @property
    def forwards(self) -> int:
        return self._total("target_forwards")

    @property
    def mean_accepted_length(self) -> float | None:
        """Committed tokens per target forward over the run (accepted drafts and looked-up tokens + 1
        per forward)."""
        forwards = self.forwards
        kept = sum(r.accepted + r.lookup_accepted for r in self.records)
        return (kept + forwards) / forwards if forwards else None

    def _total(self, name: str) -> int:
        return sum(getattr(r, name) for r in self.records)

    def _share(self, name: str, per: str) -> float | None:
        """Run total of `name` per run total of `per` (None when `per` is zero)."""
        total = self._total(per)
        return self._total(name) / total if total else None

    @property
    def acceptance_rate(self) -> float | None:
        return self._share("accepted", "drafted")

    @property
    def cache_hit_rate(self) -> float | None:
        """Speculation-cache hits per lookup (a lookup: a rejection while the cache was on)."""
        return self._share("cache_hits", "cache_lookups")

    @property
    def tree_nodes_per_forward(self) -> float | None:
        """Token-tree branch tokens (drafts' runners-up, hedges) verified per target forward."""
        return self._share("tree_nodes", "target_forwards")

    @property
    def hedge_tokens_per_forward(self) -> float | None:
        """Tokens a hedge drafted past its key that the target kept (a cache hit's continuation, or a
        tree path below a branch's root), per target forward."""
        return self._share("hedge_tokens_kept", "target_forwards")

    @property
    def tree_hit_rate(self) -> float | None:
        """Target forwards whose accepted path went into a branch, per forward."""
        return self._share("tree_hits", "target_forwards")

    @property
    def lookup_tokens_per_forward(self) -> float | None:
        """Tokens found in the requests' own text and verified (in rounds without a draft), per forward."""
        return self._share("lookup_tokens", "target_forwards")

    @property
    def lookup_acceptance(self) -> float | None:
        """Looked-up tokens the target kept, per looked-up token verified."""
        return self._share("lookup_accepted", "lookup_tokens")

    def accepted_per_pos(self) -> list[int]:
        width = max((len(r.accepted_per_pos) for r in self.records), default=0)
        return [sum(r.accepted_per_pos[i] for r in self.records if i < len(r.accepted_per_pos)) for i in range(width)]

    def verify_forward_s(self) -> float | None:
        """Mean seconds the target spent per verify round (its forward + verify rule), as it reports."""
        w = self.workers
        return w.target_busy_s / w.target_rounds if w and w.target_rounds else None

    def busy_fractions(self) -> tuple[float, float] | None:
        w = self.workers
        if w is None:
            return None
        return ar.busy_fraction(w.target_busy_s, self.wall_s), ar.busy_fraction(w.draft_busy_s, self.wall_s)


def window(before: dict, after: dict, model: str) -> WorkerWindow:
    """Differences between two `coordinator.stats()` snapshots for one model. A model whose scheduler
    was not open yet reports no worker figures: those count as zero."""

    def figure(snapshot: dict, role: str, key: str) -> float:
        return float(snapshot.get("models", {}).get(model, {}).get(role, {}).get(key, 0.0))

    def delta(role: str, key: str) -> float:
        return figure(after, role, key) - figure(before, role, key)

    return WorkerWindow(
        target_busy_s=delta("target", "busy_s"),
        target_rounds=int(delta("target", "batches")),
        verdict_handling_s=delta("target", "verdict_handling_s"),
        draft_busy_s=delta("draft", "busy_s"),
        guard_rounds=int(delta("guard", "rounds")),
        guard_drafted_rounds=int(delta("guard", "drafted_rounds")),
    )
