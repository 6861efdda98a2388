"""Prometheus metrics: names (docs/design.md#metrics), tenant labels, coordinator gauges, the HTTP endpoint."""

from __future__ import annotations

import socket
import urllib.request

from duospec.coordinator.api import FinishReason, SpecStats
from duospec.coordinator.config import ServerSettings
from duospec.coordinator.serving.metrics import ServerMetrics
from server_support import collect, request, running_server, server_coordinator


def test_finish_updates_spec_decode_counters_per_tenant():
    m = ServerMetrics()
    stats = SpecStats(drafted_tokens=8, accepted_tokens=6, target_forwards=3, pre_verify_aborts=1,
                      wasted_draft_tokens=2)
    m.observe_finish("team-a", FinishReason.LENGTH, 5, 9, stats, 0.5)
    get = m.registry.get_sample_value
    assert get("duospec:spec_decode_num_drafts_total", {"tenant": "team-a"}) == 3
    assert get("duospec:spec_decode_num_draft_tokens_total", {"tenant": "team-a"}) == 8
    assert get("duospec:spec_decode_num_accepted_tokens_total", {"tenant": "team-a"}) == 6
    assert get("duospec:spec_decode_pre_verify_aborts_total", {"tenant": "team-a"}) == 1
    assert get("duospec:spec_decode_num_wasted_draft_tokens_total", {"tenant": "team-a"}) == 2
    assert get("duospec:request_success_total", {"tenant": "team-a", "finish_reason": "length"}) == 1
    assert get("duospec:generation_tokens_total", {"tenant": "team-a"}) == 9


def test_coordinator_stats_become_gauges_and_odd_shapes_are_ignored():
    m = ServerMetrics()
    m.update_from_coordinator({"live_sequences": 3, "actors": {
        "draft": {"slots_in_use": 3, "busy_s": 1.5, "idle_s": 0.5}, "target": {"free_slots": 5}, "odd": 7}})
    m.update_from_coordinator({"live_sequences": "many", "actors": None})
    m.update_from_coordinator(None)
    m.update_from_coordinator({"tiny": {"live_sequences": 2, "verify_in_flight": False,
                                        "target": {"busy_s": 4.0, "idle_s": 1.0}, "draft": {"connected": True}}})
    get = m.registry.get_sample_value
    assert get("duospec:coordinator_live_sequences", {"model": "", "replica": "0"}) == 3
    assert get("duospec:actor_slots_in_use", {"model": "", "replica": "0", "actor": "draft"}) == 3
    assert get("duospec:actor_busy_seconds", {"model": "", "replica": "0", "actor": "draft"}) == 1.5
    assert get("duospec:actor_free_slots", {"model": "", "replica": "0", "actor": "target"}) == 5
    assert get("duospec:coordinator_live_sequences", {"model": "tiny", "replica": "0"}) == 2
    assert get("duospec:actor_busy_seconds", {"model": "tiny", "replica": "0", "actor": "target"}) == 4.0


def test_a_models_replicas_are_labelled_apart():
    m = ServerMetrics()
    m.update_from_coordinator({"ready": True, "models": {"big": {"live_sequences": 5, "replicas": {
        "0": {"live_sequences": 3, "state": "serving", "outstanding_tokens": 120, "target": {"busy_s": 2.0}},
        "1": {"live_sequences": 2, "state": "down", "outstanding_tokens": 40, "target": {"busy_s": 0.5}}}}}})
    get = m.registry.get_sample_value
    for replica, live, serving, outstanding, busy in (("0", 3, 1, 120, 2.0), ("1", 2, 0, 40, 0.5)):
        labels = {"model": "big", "replica": replica}
        assert get("duospec:coordinator_live_sequences", labels) == live
        assert get("duospec:replica_serving", labels) == serving
        assert get("duospec:replica_outstanding_tokens", labels) == outstanding
        assert get("duospec:actor_busy_seconds", {**labels, "actor": "target"}) == busy


def test_kv_pools_and_preemptions_become_gauges_and_counters():
    """Cumulative counts (preemptions, prefix-cache queries and hits) advance the counters by what
    they grew between samples, and by all of it after a worker restarted from 0."""
    m = ServerMetrics()
    get = m.registry.get_sample_value
    for preemptions, queries, hits in ((2, 100, 40), (5, 160, 64), (1, 30, 16)):  # the last: a restart
        m.update_from_coordinator({"tiny": {
            "live_sequences": 4, "num_preemptions": preemptions,
            "target": {"kv_cache_usage": 0.75, "prefix_cache_queries": queries, "prefix_cache_hits": hits},
            "draft": {"kv_cache_usage": 0.25}}})
    one = {"model": "tiny", "replica": "0"}
    assert get("duospec:kv_cache_usage_perc", {**one, "actor": "target"}) == 0.75
    assert get("duospec:kv_cache_usage_perc", {**one, "actor": "draft"}) == 0.25
    assert get("duospec:num_preemptions_total", one) == 5 + 1
    assert get("duospec:prefix_cache_queries_total", {**one, "actor": "target"}) == 160 + 30
    assert get("duospec:prefix_cache_hits_total", {**one, "actor": "target"}) == 64 + 16


def test_the_workers_grammar_costs_become_counters():
    m = ServerMetrics()
    get = m.registry.get_sample_value
    for seconds, rows, forced in ((0.5, 1000, 40), (0.75, 1600, 70)):
        m.update_from_coordinator({"tiny": {
            "live_sequences": 1, "target": {"grammar_mask_seconds": seconds, "grammar_mask_rows": rows},
            "draft": {"grammar_mask_seconds": seconds / 2, "grammar_mask_rows": rows // 2,
                      "grammar_forced_tokens": forced}}})
    target, draft = ({"model": "tiny", "replica": "0", "actor": a} for a in ("target", "draft"))
    assert get("duospec:grammar_mask_seconds_total", target) == 0.75
    assert get("duospec:grammar_mask_rows_total", target) == 1600
    assert get("duospec:grammar_mask_seconds_total", draft) == 0.375
    assert get("duospec:grammar_forced_draft_tokens_total", draft) == 70


def test_preempted_requests_count_as_waiting_not_running():
    """vLLM's meaning: a request whose KV was freed by preemption waits (to resume), and so does one
    the target's full pool has not let start, though admission holds a slot for both; the split
    follows both admission's counts and the coordinator's stats."""
    m = ServerMetrics()
    get = m.registry.get_sample_value
    m.set_admission(6, 2)
    assert (get("duospec:num_requests_running"), get("duospec:num_requests_waiting")) == (6, 2)
    m.update_from_coordinator({"ready": True, "models": {
        "a": {"live_sequences": 4, "preempted_sequences": 1},
        "b": {"replicas": {"0": {"live_sequences": 1, "waiting_for_blocks": 1}, "1": {"live_sequences": 1}}}}})
    assert (get("duospec:num_requests_running"), get("duospec:num_requests_waiting")) == (4, 4)
    m.set_admission(5, 0)  # one finished, the queue drained
    assert (get("duospec:num_requests_running"), get("duospec:num_requests_waiting")) == (3, 2)
    m.update_from_coordinator({"a": {"live_sequences": 5, "preempted_sequences": 0}})  # resumed
    assert (get("duospec:num_requests_running"), get("duospec:num_requests_waiting")) == (5, 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_metrics_endpoint_serves_request_metrics(tiny_pair):
    port = _free_port()
    settings = ServerSettings(host="127.0.0.1", port=0, metrics_port=port, http_port=0)
    async with running_server(server_coordinator(tiny_pair), settings) as h:
        await collect(h.stub, request(max_new_tokens=5))
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for name in ("duospec:time_to_first_token_seconds_count{tenant=\"default\"} 1.0",
                 "duospec:inter_token_latency_seconds_count{tenant=\"default\"}",
                 "duospec:request_success_total{finish_reason=",
                 "duospec:spec_decode_num_draft_tokens_total{tenant=\"default\"}",
                 "duospec:coordinator_live_sequences"):
        assert name in body, name


async def test_metrics_listen_on_loopback_even_when_the_api_listens_everywhere(tiny_pair):
    """Bound to 0.0.0.0 (with tenants), the server still serves /metrics on 127.0.0.1, whose tenant
    labels are not for the network, until server.metrics_host names an address."""
    from duospec.coordinator.tenants.tenancy import Tenant, hash_api_key, new_api_key

    tenants = [Tenant("alpha", key_hashes=(hash_api_key(new_api_key()),))]
    for metrics_host, expected in ((None, "127.0.0.1"), ("127.0.0.2", "127.0.0.2")):
        options = {} if metrics_host is None else {"metrics_host": metrics_host}
        settings = ServerSettings(host="0.0.0.0", port=0, metrics_port=_free_port(), http_port=0, **options)
        async with running_server(server_coordinator(tiny_pair), settings, tenants=tenants) as h:
            server, _thread = h.server._metrics_http
            assert server.server_address[0] == expected
