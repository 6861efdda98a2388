"""`duospec distill` end to end on a tiny random target, the shared loop's resume, and bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from duospec.cli.train import main as train_main
from tiny_models import make_tiny_checkpoint

# A few kB of real Python is plenty for a handful of 32-token windows.
_DATA_MODULES = ("textwrap", "string", "bisect")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", hidden_size=32, num_layers=2,
                                num_heads=2, num_kv_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    import importlib

    root = tmp_path_factory.mktemp("data")
    (root / "pkg").mkdir()
    for name in _DATA_MODULES:
        shutil.copyfile(importlib.import_module(name).__file__, root / "pkg" / f"{name}.py")
    (root / "blob.bin").write_bytes(bytes(range(256)) * 4)  # binary files in a directory are skipped
    return root


def _distill(target: Path, data, out: Path, *extra: str) -> int:
    torch.set_num_threads(1)
    data_args = [str(p) for p in (data if isinstance(data, (list, tuple)) else [data])]
    return train_main(["distill", "--target", str(target), "--data", *data_args, "--out", str(out),
                       "--draft-layers", "1", "--draft-hidden", "32", "--draft-heads", "2",
                       "--batch-size", "2", "--seq-len", "32", "--device", "cpu", *extra])


def _checkpoint_step(out: Path) -> int:
    return torch.load(out / ".distill" / "checkpoint.pt", weights_only=False)["state"]["step"]


def test_distill_writes_a_draft_that_transformers_loads(target_dir, data_dir, tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "draft"
    assert _distill(target_dir, data_dir, out, "--steps", "3") == 0

    draft = AutoModelForCausalLM.from_pretrained(str(out))
    target_config = AutoConfig.from_pretrained(str(target_dir))
    assert draft.config.model_type == "llama"
    assert draft.config.vocab_size == target_config.vocab_size
    assert draft.config.num_hidden_layers == 1 and draft.config.hidden_size == 32
    assert AutoTokenizer.from_pretrained(str(out)).get_vocab() == AutoTokenizer.from_pretrained(str(target_dir)).get_vocab()
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(k).dtype for k in weights.keys()} == {torch.float16}
    assert (out / "generation_config.json").is_file()
    assert _checkpoint_step(out) == 3
    # The model card: how it was trained, and its greedy acceptance on the data's held-out tail (this
    # tokenizer has no chat template and the data is not the stdlib, so that is the only kind).
    card = json.loads((out / "model_card.json").read_text())
    assert card["steps"] == 3 and card["train_tokens"] == 3 * 2 * 32 and card["params"] > 0
    figure = card["heldout_acceptance"]["heldout"]
    assert figure["prompts"] >= 1 and 1.0 <= figure["mean_accepted_length"] <= 5.0
    assert "held-out heldout: mean accepted length" in (out / ".distill" / "log.txt").read_text()


def test_distill_resumes_and_extends_a_finished_run(target_dir, data_dir, tmp_path):
    out = tmp_path / "draft"
    assert _distill(target_dir, data_dir, out, "--steps", "2") == 0
    assert _distill(target_dir, data_dir, out, "--steps", "4") == 0
    assert _checkpoint_step(out) == 4
    log = (out / ".distill" / "log.txt").read_text()
    assert "resumed from" in log and "at step 2" in log

    checkpoint_time = (out / ".distill" / "checkpoint.pt").stat().st_mtime_ns
    assert _distill(target_dir, data_dir, out, "--steps", "4") == 0  # nothing left to train
    assert (out / ".distill" / "checkpoint.pt").stat().st_mtime_ns == checkpoint_time


def test_interrupted_loop_resumes_to_the_same_weights(tmp_path):
    """Batches depend only on (seed, step) and the optimiser state is saved, so a run interrupted
    after a checkpoint and resumed ends with the weights of an uninterrupted run."""
    import numpy as np

    from duospec.training.data import WindowSource
    from duospec.training.loop import Logger, LoopConfig, run_loop
    from duospec.training.models import ModelShape, build_model, llama_config
    from duospec.training.objectives import DistillObjective, DraftLossWeights

    torch.set_num_threads(1)
    tokens = np.random.default_rng(0).integers(0, 64, size=2000).astype(np.uint16)
    source = WindowSource(tokens, seq_len=16, seed=0)
    cfg = LoopConfig(batch_size=2, max_steps=6, warmup_steps=2, checkpoint_every_s=0.0, eval_every_s=1e9)

    def fresh_objective():
        shape = ModelShape(hidden=16, layers=1, heads=2, kv_heads=2, intermediate=32)
        target = build_model(llama_config(shape, 64, 0, 1, 64), seed=1)
        draft = build_model(llama_config(shape, 64, 0, 1, 64), seed=2)
        return DistillObjective(target, draft, DraftLossWeights(), torch.device("cpu"))

    reference = fresh_objective()
    run_loop(reference, source, [], cfg, tmp_path / "reference.pt", Logger(tmp_path / "log.txt"))

    class Interrupt(Exception):
        pass

    class FailingSource(WindowSource):
        def batch(self, step, batch_size):
            if step == 4:
                raise Interrupt
            return super().batch(step, batch_size)

    with pytest.raises(Interrupt):
        run_loop(fresh_objective(), FailingSource(tokens, 16, 0), [], cfg, tmp_path / "run.pt",
                 Logger(tmp_path / "log.txt"))
    resumed = fresh_objective()
    state = run_loop(resumed, source, [], cfg, tmp_path / "run.pt", Logger(tmp_path / "log.txt"))
    assert state.step == 6
    for name, tensor in reference.draft.state_dict().items():
        assert torch.equal(tensor, resumed.draft.state_dict()[name]), name


@pytest.mark.parametrize("native", [False, True])
def test_bf16_autocast_only_where_the_cpu_has_native_bf16(native, tmp_path, monkeypatch):
    """Emulated bf16 trains many times slower than fp32: a CPU without AVX512-BF16 or AMX trains in
    fp32 and the log says why; one with it autocasts as asked."""
    import numpy as np

    from duospec.training import loop
    from duospec.training.data import WindowSource

    class Probe(torch.nn.Module):
        device = torch.device("cpu")

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4, 4))
            self.autocast = []

        def trainable(self):
            return {"probe": self}

        def loss(self, batch):
            self.autocast.append(torch.is_autocast_enabled("cpu"))
            return (torch.ones(1, 4) @ self.weight).float().sum(), {}

    monkeypatch.setattr(loop, "cpu_has_native_bf16", lambda: native)
    tokens = np.zeros(200, dtype=np.uint16)
    cfg = loop.LoopConfig(batch_size=1, max_steps=2, warmup_steps=1, eval_every_s=1e9, bf16_autocast=True)
    probe = Probe()
    loop.run_loop(probe, WindowSource(tokens, seq_len=8, seed=0), [], cfg, tmp_path / "run.pt",
                  loop.Logger(tmp_path / "log.txt"))
    assert probe.autocast == [native, native]
    said = "bf16 autocast off: this CPU has no native bfloat16" in (tmp_path / "log.txt").read_text()
    assert said is not native


def _gpt2_target(root: Path) -> Path:
    from transformers import GPT2Config

    GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=300).save_pretrained(str(root))
    return root


def test_distill_init_layers_fine_tunes_the_targets_first_layers(target_dir, data_dir, tmp_path):
    """`--init-layers K`: the draft starts as the target's first K layers and serves as a layers drafter."""
    from transformers import AutoModelForCausalLM

    from duospec.draft_worker.methods import build_proposer
    from duospec.draft_worker.proposer import DraftMethod, DraftSpec
    from duospec.decoding import autoregressive, decode
    from duospec.engine import load_checkpoint

    out = tmp_path / "shallow"
    assert _distill(target_dir, data_dir, out, "--init-layers", "1", "--steps", "0") == 2  # --steps < 1 refused
    assert _distill(target_dir, data_dir, out, "--init-layers", "1", "--steps", "2", "--lr", "1e-9") == 0
    draft = AutoModelForCausalLM.from_pretrained(str(out)).float()
    target = AutoModelForCausalLM.from_pretrained(str(target_dir))
    assert draft.config.num_hidden_layers == 1 and draft.config.hidden_size == target.config.hidden_size
    # Nearly no learning rate: still the target's own first layer (up to the float16 export).
    torch.testing.assert_close(draft.model.layers[0].mlp.down_proj.weight,
                               target.model.layers[0].mlp.down_proj.weight, atol=2e-3, rtol=1e-2)
    assert _checkpoint_step(out) == 2
    spec = DraftSpec(DraftMethod.LAYERS, layers=1, path=str(out))
    ckpt = load_checkpoint(target_dir, device="cpu", dtype="float32", max_slots=2)
    prompt = [5, 6, 7, 8]
    result = decode(ckpt, build_proposer(spec, str(target_dir), device="cpu", max_slots=2), prompt,
                    max_new_tokens=24, mode="vanilla", ignore_eos=True)
    assert result.token_ids == autoregressive(ckpt, prompt, max_new_tokens=24, ignore_eos=True).token_ids
    assert result.stats.drafted_tokens > 0


@pytest.mark.parametrize("case", ["unsupported_arch", "missing_data", "empty_dir", "binary_file",
                                  "bad_shape", "foreign_model_in_out", "too_many_init_layers"])
def test_bad_input_fails_before_training(case, target_dir, data_dir, tmp_path, capsys):
    target, data, out, extra = target_dir, data_dir, tmp_path / "out", []
    if case == "unsupported_arch":
        target = _gpt2_target(tmp_path / "gpt2")
        expected = "model_type 'gpt2' is not supported"
    elif case == "missing_data":
        data = tmp_path / "nope"
        expected = "no such file or directory"
    elif case == "empty_dir":
        (tmp_path / "empty").mkdir()
        data = tmp_path / "empty"
        expected = "holds no text files"
    elif case == "binary_file":
        data = data_dir / "blob.bin"
        expected = "not a UTF-8 text file"
    elif case == "bad_shape":
        extra = ["--draft-hidden", "30"]
        expected = "must give an even whole head size"
    elif case == "too_many_init_layers":
        extra = ["--init-layers", "2"]
        expected = "1 <= --init-layers < 2"
    else:
        shutil.copytree(target_dir, out)
        expected = "already holds a model that `duospec distill` did not write"
    code = _distill(target, data, out, "--steps", "1", *extra)
    assert code == 2
    assert expected in capsys.readouterr().err
    assert not (out / ".distill").exists()


def test_out_holding_another_run_is_refused(target_dir, data_dir, tmp_path, capsys):
    out = tmp_path / "draft"
    assert _distill(target_dir, data_dir, out, "--steps", "1") == 0
    checkpoint_time = (out / ".distill" / "checkpoint.pt").stat().st_mtime_ns

    # Another draft shape for the same out: a different model.
    assert train_main(["distill", "--target", str(target_dir), "--data", str(data_dir), "--out", str(out),
                       "--draft-hidden", "64", "--draft-heads", "2", "--draft-layers", "1",
                       "--batch-size", "2", "--seq-len", "32", "--steps", "1", "--device", "cpu"]) == 2
    assert "different configuration" in capsys.readouterr().err

    # A different target for the same out.
    other = make_tiny_checkpoint(tmp_path / "other", "qwen2", hidden_size=48, num_layers=1, num_heads=2,
                                 num_kv_heads=2, intermediate_size=64)
    assert _distill(other, data_dir, out, "--steps", "1") == 2
    assert "different target" in capsys.readouterr().err
    assert (out / ".distill" / "checkpoint.pt").stat().st_mtime_ns == checkpoint_time
    assert json.loads((out / ".distill" / "run.json").read_text())["draft_config"]["hidden_size"] == 32


def test_draft_loss_terms():
    from duospec.training.objectives import DraftLossWeights, draft_losses

    torch.manual_seed(0)
    target = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    total, kl, ce, agreement = draft_losses(target.clone(), target, labels, DraftLossWeights(1.0, 0.0, 0.0))
    assert kl.item() == pytest.approx(0.0, abs=1e-6) and agreement.item() == 1.0
    assert total.item() == pytest.approx(0.0, abs=1e-6)

    draft = torch.randn(2, 5, 11)
    only_argmax, *_ = draft_losses(draft, target, labels, DraftLossWeights(0.0, 0.0, 1.0))
    expected = torch.nn.functional.cross_entropy(draft.reshape(-1, 11), target.argmax(-1).reshape(-1))
    assert only_argmax.item() == pytest.approx(expected.item(), rel=1e-5)
