"""Config of scale: models[].tensor_parallel_size, draft.tensor_parallel_size and models[].replicas are
typed, default to 1, and a size the model cannot be split by is refused at load naming what works."""

from __future__ import annotations

import dataclasses

import pytest

from duospec.coordinator.config import ConfigError, ModelConfig, parse_serve_config
from duospec.coordinator.models import ModelPairError, model_info
from duospec.draft_worker.proposer import DraftSpec
from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    # 4 heads, 2 KV heads, MLP 128: sizes 1 and 2 split it
    target = make_tiny_checkpoint(root / "target", "llama", num_heads=4, num_kv_heads=2, intermediate_size=128)
    draft = make_tiny_checkpoint(root / "draft", "llama", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                                 intermediate_size=64)
    return target, draft


def _parse(model: dict):
    return parse_serve_config({"models": [{"name": "m", **model}]}, source="serve.yaml").models[0]


def test_sizes_default_to_one_and_are_read_typed(checkpoints):
    target, draft = checkpoints
    plain = _parse({"target": str(target), "draft": str(draft)})
    assert (plain.tensor_parallel_size, plain.replicas, plain.draft.tensor_parallel_size) == (1, 1, 1)
    assert ModelConfig.tensor_parallel_size == ModelConfig.replicas == DraftSpec.tensor_parallel_size == 1
    scaled = _parse({"target": str(target), "tensor_parallel_size": 2, "replicas": 3,
                     "draft": {"method": "model", "path": str(draft), "tensor_parallel_size": 2}})
    assert (scaled.tensor_parallel_size, scaled.replicas, scaled.draft.tensor_parallel_size) == (2, 3, 2)
    assert plain.placement_timeout_s == ModelConfig.placement_timeout_s == 30.0
    assert _parse({"target": str(target), "placement_timeout_s": 900}).placement_timeout_s == 900.0


@pytest.mark.parametrize("model, message", [
    ({"tensor_parallel_size": 4},
     r"models\[0\]\.tensor_parallel_size: tensor_parallel_size=4 does not divide .*4 attention heads, 2 KV heads"
     r".*sizes that work: 1, 2"),
    ({"draft": "DRAFT_MAPPING_TP3"},
     r"models\[0\]\.draft\.tensor_parallel_size: tensor_parallel_size=3 does not divide .*sizes that work: 1, 2"),
    ({"tensor_parallel_size": 0}, r"models\[0\]\.tensor_parallel_size: 0 is out of range; use an integer in \[1, 64\]"),
    ({"tensor_parallel_size": "2"}, r"models\[0\]\.tensor_parallel_size: expected int, got str '2'"),
    ({"replicas": 0}, r"models\[0\]\.replicas: 0 is out of range; use an integer in \[1, 256\]"),
    ({"replicas": 1.5}, r"models\[0\]\.replicas: expected int, got float"),
    ({"placement_timeout_s": 0}, r"models\[0\]\.placement_timeout_s: 0 is out of range"),
    ({"draft": {"method": "ngram", "tensor_parallel_size": 2}},
     r"models\[0\]\.draft\.tensor_parallel_size: not an option of method ngram"),
])
def test_bad_sizes_name_the_field_and_what_works(checkpoints, model, message):
    target, draft = checkpoints
    if model.get("draft") == "DRAFT_MAPPING_TP3":
        model = {"draft": {"method": "model", "path": str(draft), "tensor_parallel_size": 3}}
    with pytest.raises(ConfigError, match=message):
        _parse({"target": str(target), **model})


def test_a_hub_id_is_checked_when_its_workers_load():
    # not a local checkpoint: nothing to read at load; the engine checks the split at start-up
    assert _parse({"target": "org/some-model", "tensor_parallel_size": 8}).tensor_parallel_size == 8


def test_start_up_refuses_a_split_the_transformers_fallback_would_need(tmp_path):
    # dynamic rope runs on the transformers fallback, which holds the model on one device
    target = make_tiny_checkpoint(tmp_path / "t", "llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    config = ModelConfig(name="m", target=str(target), tensor_parallel_size=2)
    with pytest.raises(ModelPairError, match=r"models\[\]\.tensor_parallel_size 2: .*duospec's own forward.*set it to 1"):
        model_info(config)
    assert model_info(dataclasses.replace(config, tensor_parallel_size=1)).name == "m"


def test_replicas_multiply_what_the_admission_queue_hands_out(checkpoints):
    target, _ = checkpoints
    config = ModelConfig(name="m", target=str(target), max_num_seqs=6, replicas=3)
    assert model_info(config).max_num_seqs == 18
