"""Serve config: YAML and TOML load to the same typed config; bad values name the field and the fix."""

from __future__ import annotations

import pytest

from duospec.coordinator.api import SpeculationMode
from duospec.coordinator.config import ConfigError, ModelConfig, ServerSettings, load_serve_config, parse_serve_config

YAML = """
server: {host: 0.0.0.0, port: 50052, metrics_port: 0, max_concurrent_requests: 8, grace_period_s: 2.5}
ledger: usage.db
models:
  - name: python-tiny
    target: /opt/m/target
    draft: /opt/m/draft
    device: cpu
    speculation: {mode: vanilla, gamma: 3, max_draft_tokens: 6}
  - name: target-only
    target: /opt/m/target
"""

TOML = """
ledger = "usage.db"
[server]
host = "0.0.0.0"
port = 50052
metrics_port = 0
max_concurrent_requests = 8
grace_period_s = 2.5
[[models]]
name = "python-tiny"
target = "/opt/m/target"
draft = "/opt/m/draft"
device = "cpu"
speculation = { mode = "vanilla", gamma = 3, max_draft_tokens = 6 }
[[models]]
name = "target-only"
target = "/opt/m/target"
"""


def test_yaml_and_toml_load_the_same_config(tmp_path):
    (tmp_path / "c.yaml").write_text(YAML)
    (tmp_path / "c.toml").write_text(TOML)
    a, b = load_serve_config(tmp_path / "c.yaml"), load_serve_config(tmp_path / "c.toml")
    assert a == b
    assert a.server == ServerSettings(host="0.0.0.0", port=50052, metrics_port=0, max_concurrent_requests=8,
                                      grace_period_s=2.5)
    assert a.ledger == str(tmp_path / "usage.db")
    first, second = a.models
    assert isinstance(first, ModelConfig) and first.speculation.mode is SpeculationMode.VANILLA
    assert (first.speculation.gamma, first.speculation.max_draft_tokens, first.device) == (3, 6, "cpu")
    assert second.draft is None and second.speculation.mode is SpeculationMode.OFF


@pytest.mark.parametrize("raw, where", [
    ({"models": []}, "models"),
    ({}, "models"),
    ({"models": [{"name": "m"}]}, "models[0].target"),
    ({"models": [{"name": "m", "target": "t", "device": "tpu"}]}, "models[0].device"),
    ({"models": [{"name": "m", "target": "t", "dtype": "int4"}]}, "models[0].dtype"),
    ({"models": [{"name": "m", "target": "t", "placement": "together"}]}, "models[0].placement"),
    ({"models": [{"name": "m", "target": "t", "max_batch_size": 0}]}, "models[0].max_batch_size"),
    ({"models": [{"name": "m", "target": "t", "speculation": {"mode": "turbo"}}]}, "models[0].speculation.mode"),
    ({"models": [{"name": "m", "target": "t", "speculation": {"mode": "pearl"}}]}, "models[0].speculation.mode"),
    ({"models": [{"name": "m", "target": "t"}, {"name": "m", "target": "t"}]}, "models[1].name"),
    ({"models": [{"name": "m", "target": "t", "draft": "d", "speculation": {"hedges": 0}}]},
     "models[0].speculation.hedges"),
    ({"models": [{"name": "m", "target": "t", "draft": "d", "speculation": {"cache": "yes"}}]},
     "models[0].speculation.cache"),
    ({"models": [{"name": "m", "target": "t", "draft": "d", "speculation": {"gamma": 0}}]},
     "models[0].speculation.gamma"),
    ({"models": [{"name": "m", "target": "t", "draft": "d", "speculation": {"max_draft_tokens": 65}}]},
     "models[0].speculation.max_draft_tokens"),
    ({"models": [{"name": "m", "target": "t", "tagret": "x"}]}, "models[0].tagret"),
    ({"server": {"port": "fast"}, "models": [{"name": "m", "target": "t"}]}, "server.port"),
    ({"server": {"port": 70000}, "models": [{"name": "m", "target": "t"}]}, "server.port"),
    ({"server": {"grace_period_s": -1}, "models": [{"name": "m", "target": "t"}]}, "server.grace_period_s"),
    ({"server": {"tls": {"cert_file": "nope.pem", "key_file": "k"}}, "models": [{"name": "m", "target": "t"}]},
     "server.tls.cert_file"),
    ({"server": {"internal_tls": {"cert_file": "nope.pem", "key_file": "k", "ca_file": "c"}},
      "models": [{"name": "m", "target": "t"}]}, "server.internal_tls.cert_file"),
    ({"server": {"http_port": -1}, "models": [{"name": "m", "target": "t"}]}, "server.http_port"),
    ({"models": [{"name": "m", "target": "t", "max_num_seqs": 0}]}, "models[0].max_num_seqs"),
    ({"models": [{"name": "m", "target": "t", "restart_timeout_s": 0}]}, "models[0].restart_timeout_s"),
    ({"server": {"max_request_body_bytes": 0}, "models": [{"name": "m", "target": "t"}]},
     "server.max_request_body_bytes"),
    ({"ledger_retention_days": -1, "models": [{"name": "m", "target": "t"}]}, "ledger_retention_days"),
    ({"ledger_retention_days": "forever", "models": [{"name": "m", "target": "t"}]}, "ledger_retention_days"),
])
def test_bad_config_names_the_field(raw, where):
    with pytest.raises(ConfigError) as info:
        parse_serve_config(raw, source="c.yaml")
    assert f"c.yaml: {where}" in str(info.value)


def test_the_http_body_limit_and_the_ledger_retention():
    default = parse_serve_config({"models": [{"name": "m", "target": "t"}]})
    assert default.server.max_request_body_bytes == 4 << 20 and default.ledger_retention_days == 90.0
    set_ = parse_serve_config({"server": {"max_request_body_bytes": 65536}, "ledger_retention_days": 0,
                               "models": [{"name": "m", "target": "t"}]})
    assert set_.server.max_request_body_bytes == 65536 and set_.ledger_retention_days == 0.0  # 0: keep all


def test_placement_defaults_to_auto_and_takes_colocated():
    models = parse_serve_config({"models": [{"name": "a", "target": "t"},
                                            {"name": "b", "target": "t", "placement": "colocated"}]}).models
    assert [m.placement for m in models] == ["auto", "colocated"]


def test_internal_tls_files_and_server_name(tmp_path):
    from duospec.coordinator.config import InternalTlsSettings

    for name in ("w.pem", "w.key", "ca.pem"):
        (tmp_path / name).write_text("x")
    raw = {"server": {"internal_tls": {"cert_file": "w.pem", "key_file": "w.key", "ca_file": "ca.pem",
                                       "server_name": "workers.internal"}},
           "models": [{"name": "m", "target": "t"}]}
    settings = parse_serve_config(raw, base_dir=tmp_path).server.internal_tls
    assert settings == InternalTlsSettings(str(tmp_path / "w.pem"), str(tmp_path / "w.key"), str(tmp_path / "ca.pem"),
                                           "workers.internal")


def test_unknown_suffix_and_missing_file(tmp_path):
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"\.yaml, \.yml or \.toml"):
        load_serve_config(tmp_path / "c.json")
    with pytest.raises(ConfigError, match="no such file"):
        load_serve_config(tmp_path / "missing.yaml")


def _draft_config(draft, target="t"):
    return {"models": [{"name": "m", "target": str(target), "draft": draft}]}


def test_draft_as_a_path_or_a_mapping(tmp_path):
    from duospec.draft_worker.proposer import DraftMethod, DraftSpec, NgramOptions

    (tmp_path / "d").mkdir()
    model = parse_serve_config(_draft_config("d"), base_dir=tmp_path).models[0]
    assert model.draft == DraftSpec(DraftMethod.MODEL, path=str(tmp_path / "d"))
    assert model.speculation.mode is SpeculationMode.PEARL
    model = parse_serve_config(_draft_config({"method": "model", "path": "d"}), base_dir=tmp_path).models[0]
    assert model.draft == DraftSpec(DraftMethod.MODEL, path=str(tmp_path / "d"))
    model = parse_serve_config(_draft_config({"method": "ngram", "max_ngram": 5, "pool": "sequence"})).models[0]
    assert model.draft == DraftSpec(DraftMethod.NGRAM, ngram=NgramOptions(max_ngram=5, pool="sequence"))
    model = parse_serve_config(_draft_config({"method": "layers", "layers": 2})).models[0]
    assert model.draft == DraftSpec(DraftMethod.LAYERS, layers=2)
    assert model.draft.context_lookup  # on unless turned off
    off = parse_serve_config(_draft_config({"method": "model", "path": "d", "context_lookup": False}),
                             base_dir=tmp_path).models[0]
    assert off.draft == DraftSpec(DraftMethod.MODEL, path=str(tmp_path / "d"), context_lookup=False)
    assert model.draft.float16_products  # on unless turned off
    exact = parse_serve_config(_draft_config({"method": "layers", "layers": 2, "float16_products": False})).models[0]
    assert exact.draft == DraftSpec(DraftMethod.LAYERS, layers=2, float16_products=False)
    assert model.draft.checkpoint("/m/target") == "/m/target"
    assert ModelConfig(name="m", target="t", draft="/d").draft == DraftSpec(DraftMethod.MODEL, path="/d")


@pytest.mark.parametrize("draft, where, fix", [
    ({"method": "medusa-ish"}, "draft.method", "use one of model, layers, ngram"),
    ({"path": "d"}, "draft.method", "missing"),
    ({"method": "ngram", "path": "d"}, "draft.path", "needs no checkpoint"),
    ({"method": "ngram", "min_ngram": 5, "max_ngram": 3}, "draft.min_ngram", "above max_ngram"),
    ({"method": "ngram", "pool": "everyone"}, "draft.pool", "tenant, sequence"),
    ({"method": "model"}, "draft.path", "missing"),
    ({"method": "layers"}, "draft.layers", "missing"),
    ({"method": "layers", "layers": 0}, "draft.layers", "out of range"),
    ({"method": "layers", "layers": 2, "max_ngram": 3}, "draft.max_ngram", "not an option of method layers"),
    ({"method": "ngram", "context_lookup": False}, "draft.context_lookup", "not an option of method ngram"),
    ({"method": "model", "path": "d", "context_lookup": "yes"}, "draft.context_lookup", "bool"),
    ({"method": "model", "path": "d", "stop_confidence": 1.5}, "draft.stop_confidence", "out of range"),
    ({"method": "eagle3", "path": "d", "float16_products": False}, "draft.float16_products",
     "not an option of method eagle3"),
    (7, "draft", "expected str or dict"),
])
def test_bad_draft_names_the_field_and_the_fix(draft, where, fix):
    with pytest.raises(ConfigError) as info:
        parse_serve_config(_draft_config(draft), source="c.yaml")
    assert f"c.yaml: models[0].{where}" in str(info.value) and fix in str(info.value)


def test_layers_must_be_fewer_than_the_targets(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text('{"num_hidden_layers": 4}')
    for layers in (4, 9):
        with pytest.raises(ConfigError, match=r"draft.layers: .*the target has 4 layers.*layers: 2"):
            parse_serve_config(_draft_config({"method": "layers", "layers": layers}, tmp_path / "target"))
    assert parse_serve_config(_draft_config({"method": "layers", "layers": 3}, tmp_path / "target")).models[0].draft


def test_an_empty_draft_path_means_no_drafter_and_an_empty_mapping_path_is_refused():
    assert parse_serve_config(_draft_config("")).models[0].draft is None
    with pytest.raises(ConfigError, match=r"models\[0\].draft.path: empty"):
        parse_serve_config(_draft_config({"method": "model", "path": ""}))


def test_the_speculation_cache_is_config_and_per_request():
    from duospec.coordinator.api import GenerationRequest
    from duospec.coordinator.scheduling.router import ModelRouter

    def model(speculation):
        raw = {"models": [{"name": "m", "target": "t", "draft": "d", "speculation": speculation}]}
        return parse_serve_config(raw, source="c.yaml").models[0]

    on, off = model({"cache": True, "hedges": 3}), model({"cache": False})
    assert (on.speculation.cache, on.speculation.hedges, off.speculation.cache) == (True, 3, False)
    router = ModelRouter()
    entry = type("Entry", (), {"info": type("Info", (), {"has_draft": True})()})

    def hedges(config, mode=None, cache=None):
        entry.config = config
        request = GenerationRequest("r", (1,), 4, mode=mode, speculation_cache=cache)
        return router.policy_for(entry, request).max_hedges()

    assert (hedges(on), hedges(off), hedges(on, cache=False), hedges(off, cache=True)) == (3, 0, 0, off.speculation.hedges)
    assert hedges(on, mode=SpeculationMode.VANILLA) == 0  # vanilla stays the textbook chain


def test_vanilla_takes_gamma_and_pearl_its_cap_unless_the_request_asks():
    """Two defaults: vanilla's fixed γ and pearl's larger cap (it drafts while the target verifies and
    adapts its length, so a longer chunk costs it no waiting); a request's own count wins in both."""
    from duospec.coordinator.api import GenerationRequest
    from duospec.coordinator.config import SpeculationDefaults
    from duospec.coordinator.scheduling.router import ModelRouter

    assert (SpeculationDefaults().gamma, SpeculationDefaults().max_draft_tokens) == (4, 8)
    config = parse_serve_config({"models": [{"name": "m", "target": "t", "draft": "d",
                                             "speculation": {"gamma": 3, "max_draft_tokens": 6}}]}, source="c.yaml")
    entry = type("Entry", (), {"info": type("Info", (), {"has_draft": True})(), "config": config.models[0]})
    router = ModelRouter()

    def drafts(mode, asked=None):
        policy = router.policy_for(entry, GenerationRequest("r", (1,), 4, mode=mode, max_draft_tokens=asked))
        return policy.max_draft_tokens

    assert (drafts(SpeculationMode.VANILLA), drafts(SpeculationMode.PEARL), drafts(None)) == (3, 6, 6)
    assert (drafts(SpeculationMode.VANILLA, 5), drafts(SpeculationMode.PEARL, 2)) == (5, 2)


def test_kv_memory_and_prefix_cache_per_model_and_draft():
    from duospec.coordinator.models import worker_kv

    base = {"name": "m", "target": "/opt/m/target"}
    default = parse_serve_config({"models": [base]}).models[0]
    assert (default.kv_cache_memory_bytes, default.gpu_memory_utilization, default.prefix_cache) == \
        (ModelConfig.kv_cache_memory_bytes, ModelConfig.gpu_memory_utilization, "tenant")
    model = parse_serve_config({"models": [{
        **base, "kv_cache_memory_bytes": 1 << 30, "gpu_memory_utilization": 0.5, "prefix_cache": "shared",
        "draft": {"method": "model", "path": "/opt/m/draft", "kv_cache_memory_bytes": 1 << 20}}]}).models[0]
    target, draft = worker_kv(model, "target"), worker_kv(model, "draft")
    assert (target.kv_cache_memory_bytes, target.gpu_memory_utilization, target.prefix_caching) == (1 << 30, 0.5, True)
    assert draft.kv_cache_memory_bytes == 1 << 20  # the draft's own
    off = parse_serve_config({"models": [{**base, "prefix_cache": "off"}]}).models[0]
    assert not worker_kv(off, "target").prefix_caching
    for raw, message in [({"prefix_cache": "everyone"}, r"models\[0\]\.prefix_cache: 'everyone' is not one of tenant, shared, off"),
                         ({"gpu_memory_utilization": 1.5}, r"models\[0\]\.gpu_memory_utilization: 1.5 is out of range"),
                         ({"kv_cache_memory_bytes": 12}, r"models\[0\]\.kv_cache_memory_bytes: 12 is out of range"),
                         ({"draft": {"method": "ngram", "kv_cache_memory_bytes": 1 << 20}},
                          r"draft\.kv_cache_memory_bytes: not an option of method ngram")]:
        with pytest.raises(ConfigError, match=message):
            parse_serve_config({"models": [{**base, **raw}]})
