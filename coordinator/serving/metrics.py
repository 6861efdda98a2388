"""Prometheus metrics (docs/design.md#metrics), on the server's own CollectorRegistry.

Counter names follow vLLM where the concept exists (`duospec:` instead of `vllm:`); prometheus_client
appends `_total` to counters on exposition, as vLLM's do. Every per-request series has a `tenant`
label. `duospec:spec_decode_num_accepted_tokens_per_pos{position}` counts, for each offset in a
verified chunk, how often the draft token there was accepted (from SpecStats.accepted_per_pos).

Gauges about the actors come from `await coordinator.stats()`, sampled by the server on a timer
(collection runs on the HTTP thread, which cannot await); keys are read defensively because the
stats dict belongs to the coordinator:
    {model: {"live_sequences": int, "num_preemptions": int,
             "target": {"busy_s": float, "idle_s": float, "slots_in_use": int, "free_slots": int,
                        "kv_cache_usage": float, "prefix_cache_queries": int, "prefix_cache_hits": int},
             "draft": {...}}}
or the same without the model level; an optional top-level "ready": bool drives health. Cumulative
counts there (preemptions, prefix-cache queries and hits) advance the counters by what they grew since
the last sample (from 0 again after a worker restart). A model of several replicas
(coordinator/scheduling/replicas.py) reports each replica's such dict under {"replicas": {"0": ..., "1": ...}},
with its "state" and "outstanding_tokens"; every series of a model's workers has a `replica` label
("0" for a model of one pair).
"""

from __future__ import annotations

import math
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from duospec.coordinator.api import FinishReason, SpecStats

UNAUTHENTICATED_TENANT = "(unauthenticated)"  # not a valid tenant name, so it cannot collide with one
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r, t = self.registry, ["tenant"]
        self.num_drafts = Counter("duospec:spec_decode_num_drafts", "Verify passes over draft tokens", t, registry=r)
        self.num_draft_tokens = Counter(
            "duospec:spec_decode_num_draft_tokens", "Draft tokens sent to the target", t, registry=r)
        self.num_accepted_tokens = Counter(
            "duospec:spec_decode_num_accepted_tokens", "Draft tokens the target accepted", t, registry=r)
        self.num_accepted_tokens_per_pos = Counter(
            "duospec:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by offset in the chunk",
            (*t, "position"), registry=r)
        self.pre_verify_aborts = Counter(
            "duospec:spec_decode_pre_verify_aborts", "Rounds aborted at the first draft token", t, registry=r)
        self.cache_lookups = Counter(
            "duospec:spec_decode_cache_lookups", "Rejections that looked up the speculation cache", t, registry=r)
        self.cache_hits = Counter(
            "duospec:spec_decode_cache_hits", "Speculation-cache lookups that found a hedge", t, registry=r)
        self.tree_nodes = Counter(
            "duospec:spec_decode_tree_nodes", "Token-tree branch tokens verified beside the main chain (drafts' runners-up and hedges)", t, registry=r)
        self.tree_hits = Counter(
            "duospec:spec_decode_tree_hits", "Verify passes whose accepted path went into a branch", t, registry=r)
        self.hedge_tokens_kept = Counter(
            "duospec:spec_decode_hedge_tokens_kept",
            "Tokens a hedge drafted past its key that the target kept (cache hit or tree branch)", t, registry=r)
        self.lookup_tokens = Counter(
            "duospec:spec_decode_lookup_tokens", "Tokens found in a request's own text, verified without a draft",
            t, registry=r)
        self.lookup_accepted = Counter(
            "duospec:spec_decode_lookup_accepted_tokens", "Looked-up tokens the target kept", t, registry=r)
        self.wasted_draft_tokens = Counter(
            "duospec:spec_decode_num_wasted_draft_tokens", "Draft tokens discarded after a rejection", t, registry=r)
        # constrained requests (a JSON schema, regex, grammar or tool calls): their acceptance on its own
        self.constrained_requests = Counter(
            "duospec:constrained_requests", "Finished requests with a constraint", t, registry=r)
        self.constrained_draft_tokens = Counter(
            "duospec:spec_decode_constrained_num_draft_tokens", "Draft tokens of constrained requests", t, registry=r)
        self.constrained_accepted_tokens = Counter(
            "duospec:spec_decode_constrained_num_accepted_tokens", "Accepted draft tokens of constrained requests",
            t, registry=r)
        self.grammar_compile = Histogram(
            "duospec:grammar_compile_seconds", "Time to check a request's constraint at the gateway (a cached "
            "compile is a lookup)", ["model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("duospec:prompt_tokens", "Prompt tokens processed", t, registry=r)
        self.generation_tokens = Counter("duospec:generation_tokens", "Tokens generated", t, registry=r)
        self.request_success = Counter(
            "duospec:request_success", "Finished requests by finish reason", ["tenant", "finish_reason"], registry=r)
        self.request_failure = Counter(
            "duospec:request_failure", "Requests that ended with an error status", ["tenant", "code"], registry=r)
        self.request_refused = Counter(
            "duospec:request_refused",
            f"Requests refused before admission (bad key, over quota, invalid, too large) by gRPC status; "
            f"tenant {UNAUTHENTICATED_TENANT!r} for a missing or unknown key", ["tenant", "code"], registry=r)
        self.ledger_write_failures = Counter(
            "duospec:ledger_write_failures",
            "Usage-ledger writes that failed (rows missing or stale until a later write succeeds); alert on any",
            ["operation"], registry=r)
        self.quota_store_failures = Counter(
            "duospec:quota_store_failures",
            "Quota checks the shared store (PostgreSQL) could not answer, decided by this gateway's own budgets "
            "instead (fail open); alert on any", ["operation"], registry=r)
        self.ttft = Histogram("duospec:time_to_first_token_seconds", "Time to first token", t,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("duospec:inter_token_latency_seconds", "Time between committed tokens", t,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("duospec:e2e_request_latency_seconds", "Request latency", t,
                             buckets=_LATENCY_BUCKETS, registry=r)
        # vLLM's meaning: running = holding KV and generating; waiting = queued for a slot, or preempted
        # (KV freed, waiting to resume). Admission counts the latter as running (they keep their slot),
        # so the preempted ones, from the coordinator's stats, are moved across (_publish_requests).
        self.streams_running = Gauge("duospec:num_requests_running",
                                     "Requests generating (holding KV cache; preempted ones are waiting)", registry=r)
        self.streams_waiting = Gauge("duospec:num_requests_waiting",
                                     "Requests waiting: queued for a slot, or preempted and waiting to resume",
                                     registry=r)
        self._admitted = self._queued = self._preempted = 0
        m, a = ["model", "replica"], ["model", "replica", "actor"]
        self.live_sequences = Gauge("duospec:coordinator_live_sequences", "Sequences the coordinator holds",
                                    m, registry=r)
        self.replica_serving = Gauge("duospec:replica_serving",
                                     "1 while the replica takes requests (its target is up), else 0", m, registry=r)
        self.outstanding_tokens = Gauge("duospec:replica_outstanding_tokens",
                                        "Tokens the replica's live requests may still produce (what routing weighs)",
                                        m, registry=r)
        self.slots_in_use = Gauge("duospec:actor_slots_in_use", "KV slots in use", a, registry=r)
        self.free_slots = Gauge("duospec:actor_free_slots", "KV slots free", a, registry=r)
        self.busy_seconds = Gauge("duospec:actor_busy_seconds", "Seconds the actor spent computing", a, registry=r)
        self.idle_seconds = Gauge("duospec:actor_idle_seconds", "Seconds the actor waited for work", a, registry=r)
        self.kv_cache_usage = Gauge("duospec:kv_cache_usage_perc",
                                    "Fraction of the worker's KV blocks held by sequences (1 = full)", a, registry=r)
        self.prefix_cache_queries = Counter("duospec:prefix_cache_queries",
                                            "Prompt positions looked up in the worker's prefix cache", a, registry=r)
        self.prefix_cache_hits = Counter("duospec:prefix_cache_hits",
                                         "Prompt positions read from the worker's prefix cache instead of computed",
                                         a, registry=r)
        # a gateway's requests that went on from their last token after their replica's scheduler
        # actor was lost (coordinator/remote.py)
        self.requests_continued = Counter("duospec:requests_continued",
                                          "Requests continued on another scheduler after theirs was lost", registry=r)
        # Constrained requests on the workers: the target masks every verify row, the drafter its own
        # proposals; seconds over rows is the mask time per token on each side.
        self.grammar_mask_seconds = Counter("duospec:grammar_mask_seconds",
                                            "Seconds the worker spent filling grammar masks", a, registry=r)
        self.grammar_mask_rows = Counter("duospec:grammar_mask_rows",
                                         "Token positions the worker masked by a grammar", a, registry=r)
        self.grammar_forced_tokens = Counter("duospec:grammar_forced_draft_tokens",
                                             "Draft tokens the grammar forced (drafted without a model step)", a,
                                             registry=r)
        self.num_preemptions = Counter("duospec:num_preemptions",
                                       "Sequences preempted (KV freed, resumed later by recompute) when the "
                                       "target's KV cache ran out", m, registry=r)
        self._totals: dict[tuple, float] = {}  # (id of a counter, labels) -> the cumulative value last sampled

    def observe_first_token(self, tenant: str, seconds: float) -> None:
        self.ttft.labels(tenant).observe(seconds)

    def observe_tokens(self, tenant: str, n_tokens: int, seconds_since_last: float) -> None:
        """A commit of n tokens after `seconds_since_last`: n inter-token gaps of seconds/n each."""
        if n_tokens <= 0:
            return
        gap = seconds_since_last / n_tokens
        hist = self.itl.labels(tenant)
        for _ in range(n_tokens):
            hist.observe(gap)

    def observe_finish(self, tenant: str, finish_reason: FinishReason, prompt_tokens: int,
                       completion_tokens: int, stats: SpecStats, e2e_seconds: float, *, constrained: bool = False) -> None:
        self.request_success.labels(tenant, finish_reason.value).inc()
        if constrained:
            self.constrained_requests.labels(tenant).inc()
            self.constrained_draft_tokens.labels(tenant).inc(stats.drafted_tokens)
            self.constrained_accepted_tokens.labels(tenant).inc(stats.accepted_tokens)
        self.prompt_tokens.labels(tenant).inc(prompt_tokens)
        self.generation_tokens.labels(tenant).inc(completion_tokens)
        self.e2e.labels(tenant).observe(e2e_seconds)
        if stats.drafted_tokens:
            self.num_drafts.labels(tenant).inc(stats.target_forwards)
        self.num_draft_tokens.labels(tenant).inc(stats.drafted_tokens)
        self.num_accepted_tokens.labels(tenant).inc(stats.accepted_tokens)
        for position, count in enumerate(stats.accepted_per_pos):
            self.num_accepted_tokens_per_pos.labels(tenant, str(position)).inc(count)
        self.pre_verify_aborts.labels(tenant).inc(stats.pre_verify_aborts)
        self.wasted_draft_tokens.labels(tenant).inc(stats.wasted_draft_tokens)
        self.cache_lookups.labels(tenant).inc(stats.cache_lookups)
        self.cache_hits.labels(tenant).inc(stats.cache_hits)
        self.tree_nodes.labels(tenant).inc(stats.tree_nodes)
        self.tree_hits.labels(tenant).inc(stats.tree_hits)
        self.lookup_tokens.labels(tenant).inc(stats.lookup_tokens)
        self.lookup_accepted.labels(tenant).inc(stats.lookup_accepted)
        self.hedge_tokens_kept.labels(tenant).inc(stats.hedge_tokens_kept)

    def observe_grammar_compile(self, model: str, seconds: float) -> None:
        self.grammar_compile.labels(model).observe(seconds)

    def observe_failure(self, tenant: str, code: str) -> None:
        self.request_failure.labels(tenant, code).inc()

    def observe_refusal(self, tenant: str | None, code: str) -> None:
        """A request refused before admission; `tenant` None: its key was missing or unknown."""
        self.request_refused.labels(tenant or UNAUTHENTICATED_TENANT, code).inc()

    def observe_ledger_failure(self, operation: str) -> None:
        self.ledger_write_failures.labels(operation).inc()

    def observe_quota_failure(self, operation: str) -> None:
        self.quota_store_failures.labels(operation).inc()

    def set_admission(self, admitted: int, queued: int) -> None:
        """Admission's counts: requests holding a generation slot, and those queued for one."""
        self._admitted, self._queued = admitted, queued
        self._publish_requests()

    def _publish_requests(self) -> None:
        preempted = min(self._preempted, self._admitted)
        self.streams_running.set(self._admitted - preempted)
        self.streams_waiting.set(self._queued + preempted)

    def update_from_coordinator(self, stats: Any) -> None:
        """Copies what it recognizes from `coordinator.stats()`; unknown shapes are skipped."""
        preempted = 0.0
        for model, entry in per_model_stats(stats).items():
            for replica, values in _replica_stats(entry).items():
                self._update_replica(model, replica, values)
                for key in ("preempted_sequences", "waiting_for_blocks"):  # hold a slot, not KV
                    preempted += _number(values.get(key)) or 0.0
        self._preempted = int(preempted)
        if isinstance(stats, dict):
            self._advance(self.requests_continued, stats.get("continued_requests"))
        self._publish_requests()

    def _update_replica(self, model: str, replica: str, entry: dict) -> None:
        for key, gauge in (("live_sequences", self.live_sequences), ("outstanding_tokens", self.outstanding_tokens)):
            value = _number(entry.get(key))
            if value is not None:
                gauge.labels(model, replica).set(value)
        if isinstance(entry.get("state"), str):
            self.replica_serving.labels(model, replica).set(float(entry["state"] != "down"))
        self._advance(self.num_preemptions, entry.get("num_preemptions"), model, replica)
        for actor, values in _actor_stats(entry).items():
            for key, gauge in (("slots_in_use", self.slots_in_use), ("free_slots", self.free_slots),
                               ("busy_s", self.busy_seconds), ("idle_s", self.idle_seconds),
                               ("kv_cache_usage", self.kv_cache_usage)):
                value = _number(values.get(key))
                if value is not None:
                    gauge.labels(model, replica, actor).set(value)
            for key, counter in (("prefix_cache_queries", self.prefix_cache_queries),
                                 ("prefix_cache_hits", self.prefix_cache_hits),
                                 ("grammar_mask_seconds", self.grammar_mask_seconds),
                                 ("grammar_mask_rows", self.grammar_mask_rows),
                                 ("grammar_forced_tokens", self.grammar_forced_tokens)):
                self._advance(counter, values.get(key), model, replica, actor)

    def _advance(self, counter: Counter, total: Any, *labels: str) -> None:
        """Moves `counter` on by what the sampled cumulative `total` grew (all of it after a restart)."""
        value = _number(total)
        if value is None:
            return
        key = (id(counter), labels)
        last = self._totals.get(key, 0.0)
        (counter.labels(*labels) if labels else counter).inc(value - last if value >= last else value)
        self._totals[key] = value

    def serve(self, port: int, host: str = "127.0.0.1"):
        """Starts the /metrics HTTP endpoint on its own thread; returns (server, thread)."""
        return start_http_server(port, addr=host, registry=self.registry)


def per_model_stats(stats: Any) -> dict[str, dict]:
    """`{model: {...}}` (the router's shape) or one flat dict (a single-model coordinator, as "")."""
    if not isinstance(stats, dict):
        return {}
    if isinstance(stats.get("models"), dict):  # the router's {"ready": ..., "models": {...}}
        stats = stats["models"]
    if "live_sequences" in stats or "actors" in stats:
        return {"": stats}
    return {str(k): v for k, v in stats.items() if isinstance(v, dict)}


def live_sequences(stats: Any) -> int:
    """Sequences alive across all models (0 when the stats do not say)."""
    return int(sum(_number(e.get("live_sequences")) or 0 for e in per_model_stats(stats).values()))


def _replica_stats(entry: dict) -> dict[str, dict]:
    """{replica: its stats}: a model of several replicas lists them under "replicas"; one is replica "0"."""
    replicas = entry.get("replicas")
    if isinstance(replicas, dict):
        return {str(k): v for k, v in replicas.items() if isinstance(v, dict)}
    return {"0": entry}


def _actor_stats(entry: dict) -> dict[str, dict]:
    actors = entry.get("actors") if isinstance(entry.get("actors"), dict) else entry
    return {str(k): v for k, v in actors.items() if isinstance(v, dict) and k != "actors"}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)
