"""Bad input to the engine loader: one clear CheckpointError naming the path (or option) and the fix."""

from __future__ import annotations

import shutil

import pytest

from duospec.engine import CheckpointError, load_checkpoint, load_model, load_tokenizer
from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("errors") / "llama", "llama", seed=5)


def test_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError, match=rf"{missing}: no such checkpoint directory"):
        load_model(missing)


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=rf"{tmp_path}: not a checkpoint directory \(no config.json\)"):
        load_model(tmp_path)


def test_config_without_weights(tmp_path, ckpt):
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=rf"{tmp_path}: config.json but no weights"):
        load_model(tmp_path)


def test_corrupt_weights(tmp_path, ckpt):
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=rf"{tmp_path}: transformers cannot load the weights"):
        load_model(tmp_path)


@pytest.mark.parametrize("dtype", ["float64", "int8", "fp32", None])
def test_unsupported_dtype(ckpt, dtype):
    with pytest.raises(CheckpointError, match=rf"dtype={dtype!r} is not supported; use 'auto', 'float32'"):
        load_model(ckpt, dtype=dtype)


def test_unknown_backend(ckpt):
    with pytest.raises(CheckpointError, match="backend='fast' is not one of"):
        load_model(ckpt, backend="fast")


def test_lean_backend_refuses_other_architectures(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"backend='lean' cannot run this model \(model_type 'gpt2'"):
        load_model(tmp_path, backend="lean")


def test_max_context_beyond_the_model(ckpt):
    with pytest.raises(CheckpointError, match="max_context=1024 exceeds the model's max_position_embeddings=512"):
        load_model(ckpt, max_context=1024)


def test_tokenizer_larger_than_the_model_vocabulary(tmp_path):
    small = make_tiny_checkpoint(tmp_path / "small", "llama", vocab_size=300)
    with pytest.raises(CheckpointError, match=r"tokenizer has 384 tokens but the model's vocab_size is 300"):
        load_checkpoint(small)


def test_padded_model_vocabulary_is_fine(tmp_path):
    padded = make_tiny_checkpoint(tmp_path / "padded", "qwen2", vocab_size=400)
    ckpt = load_checkpoint(padded, max_context=16)
    assert ckpt.runner.vocab_size == 400 and len(ckpt.tokenizer) == 384


def test_missing_tokenizer(tmp_path, ckpt):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(ckpt / name, tmp_path / name)
    with pytest.raises(CheckpointError, match=rf"{tmp_path}: no usable tokenizer"):
        load_tokenizer(tmp_path)
