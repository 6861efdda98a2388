"""A draft model with a trimmed output vocabulary (duospec/engine/draft_vocab.py, `duospec distill
--draft-vocab N`): trained on the target's cached outputs, resumable to the step, served as a plain
`model` drafter whose q is zero outside its vocabulary, and exact: greedy output equals the target
alone, tokens outside the draft vocabulary included (the target's corrections)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from duospec.cli.train import main as train_main
from duospec.engine import CheckpointError, SlotChunk, load_model
from duospec.engine.draft_vocab import DRAFT_VOCAB_FILE, read_draft_vocab
from tiny_models import make_tiny_checkpoint

VOCAB = 40  # of the tiny target's vocabulary, the draft keeps this many


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dv") / "target", "llama", hidden_size=32, num_layers=2,
                                num_heads=2, num_kv_heads=2, intermediate_size=64)


def _distill(target_dir, out, *extra: str) -> int:
    torch.set_num_threads(1)
    return train_main(["distill", "--target", str(target_dir), "--data", "stdlib", "--stdlib-tokens", "3000",
                       "--out", str(out), "--draft-vocab", str(VOCAB), "--draft-layers", "1", "--draft-hidden", "32",
                       "--draft-heads", "2", "--batch-size", "2", "--seq-len", "32", "--eval-prompts", "2",
                       "--device", "cpu", *extra])


@pytest.fixture(scope="module")
def trained(target_dir, tmp_path_factory):
    """(one run of 4 steps, the same run split 2 + 2), both written."""
    root = tmp_path_factory.mktemp("dv-runs")
    assert _distill(target_dir, root / "straight", "--steps", "4") == 0
    assert _distill(target_dir, root / "split", "--steps", "2") == 0
    assert _distill(target_dir, root / "split", "--steps", "4") == 0
    return root / "straight", root / "split"


def test_distill_writes_a_trimmed_draft_and_resumes_on_the_same_curve(target_dir, trained):
    straight, split = trained
    cards = [json.loads((d / "model_card.json").read_text()) for d in trained]
    assert cards[0]["steps"] == cards[1]["steps"] == 4
    assert cards[1]["last_eval"] == pytest.approx(cards[0]["last_eval"], rel=1e-4)  # the same curve
    assert cards[0]["draft_vocab"] == VOCAB and set(cards[0]["heldout_acceptance"]) == {"code"}
    assert "resumed from" in (split / ".distill" / "log.txt").read_text()
    ids = read_draft_vocab(straight, 10_000)
    assert ids is not None and len(ids) == VOCAB and bool((ids[1:] > ids[:-1]).all())
    assert AutoModelForCausalLM.from_pretrained(str(straight)).config.vocab_size > VOCAB  # still a whole checkpoint


def test_the_engine_computes_the_draft_vocabulary_only(target_dir, trained):
    draft_dir = trained[0]
    ids = read_draft_vocab(draft_dir, 10_000)
    hf = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    runner = load_model(draft_dir, device="cpu", dtype="float32", max_slots=1, drafter=True)
    assert runner.lm_head.shape[0] == VOCAB  # the step's LM head is the trimmed one
    tokens = [3, 9, 4, 11, 2, 8]
    logits = runner.forward([SlotChunk(runner.allocate_slot(), 0, tokens)])[0]
    with torch.no_grad():
        reference = hf(input_ids=torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(logits[:, ids], reference[:, ids], atol=1e-4, rtol=1e-4)
    outside = torch.ones(logits.shape[1], dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(logits[:, outside]).all()
    # A target (or any load that is not a drafter's) keeps its whole head.
    assert load_model(draft_dir, device="cpu", dtype="float32", max_slots=1).lm_head.shape[0] > VOCAB


@pytest.mark.parametrize("mode", ["vanilla", "pearl"])
def test_greedy_output_is_the_targets_with_tokens_outside_the_draft_vocabulary(target_dir, trained, mode):
    from duospec.decoding import autoregressive, decode
    from duospec.draft_worker.methods import build_proposer
    from duospec.draft_worker.proposer import DraftMethod, DraftSpec
    from duospec.engine import load_checkpoint

    ids = set(read_draft_vocab(trained[0], 10_000).tolist())
    ckpt = load_checkpoint(target_dir, device="cpu", dtype="float32", max_slots=2)
    spec = DraftSpec(DraftMethod.MODEL, path=str(trained[0]))
    outside = drafted = 0
    for prompt in ([5, 6, 7, 8], [40, 41, 2, 9, 17], [100, 3, 3, 7]):
        result = decode(ckpt, build_proposer(spec, str(target_dir), device="cpu", max_slots=2), prompt,
                        max_new_tokens=24, mode=mode, ignore_eos=True)
        assert result.token_ids == autoregressive(ckpt, prompt, max_new_tokens=24, ignore_eos=True).token_ids
        outside += sum(t not in ids for t in result.token_ids)
        drafted += result.stats.drafted_tokens
    assert drafted > 0
    assert outside > 0  # the random target emits tokens the draft cannot propose: they came as corrections


@pytest.mark.parametrize("mode", ["vanilla", "pearl"])
def test_greedy_output_is_the_targets_with_a_drafter_multiplying_in_half(target_dir, trained, mode, monkeypatch):
    """The drafter's every product in float16 (forced: these weights are too small to be measured):
    drafts change at most, the output is the target's alone, and the target's products stay float32."""
    from duospec.decoding import autoregressive, decode
    from duospec.draft_worker.methods import build_proposer
    from duospec.draft_worker.proposer import DraftMethod, DraftSpec
    from duospec.engine import cpu_linear, load_checkpoint

    if not cpu_linear.half_linear_works():
        pytest.skip("no float16 GEMM in this torch build")
    half, plain = (cpu_linear.Kernel.HALF,) * 5, (cpu_linear.Kernel.PLAIN,) * 5
    monkeypatch.setattr(cpu_linear, "MEASURE_MIN_ELEMENTS", 0)
    monkeypatch.setattr(cpu_linear, "kernel_choices",
                        lambda out, inp, copies=1, kernels=(): half if cpu_linear.Kernel.HALF in kernels else plain)
    ckpt = load_checkpoint(target_dir, device="cpu", dtype="float32", max_slots=2)
    assert ckpt.runner.lm_head.choices == plain
    proposer = build_proposer(DraftSpec(DraftMethod.MODEL, path=str(trained[0])), str(target_dir), device="cpu",
                              max_slots=2)
    assert proposer.runner.layers[0].qkv.choices == half
    for prompt in ([5, 6, 7, 8], [40, 41, 2, 9, 17]):
        result = decode(ckpt, proposer, prompt, max_new_tokens=24, mode=mode, ignore_eos=True)
        assert result.token_ids == autoregressive(ckpt, prompt, max_new_tokens=24, ignore_eos=True).token_ids
        assert result.stats.drafted_tokens > 0


def test_transformers_assisted_generation_runs_the_draft_with_its_vocabulary(target_dir, trained):
    """`duospec bench`'s hf-assisted baseline: the assistant's untrained rows are never proposed, and the
    output is still the target's."""
    from duospec.bench.inprocess import BenchPair, EncodedPrompt, HFGenerate

    hf = HFGenerate(BenchPair(target=str(target_dir), draft=str(trained[0])))
    ids = read_draft_vocab(trained[0], 10_000)
    with torch.no_grad():
        logits = hf.draft(input_ids=torch.tensor([[5, 6, 7, 8]])).logits[0]
    kept = torch.zeros(logits.shape[1], dtype=torch.bool)
    kept[ids] = True
    assert torch.isneginf(logits[:, ~kept]).all() and torch.isfinite(logits[:, kept]).all()
    prompt = EncodedPrompt("p", (5, 6, 7, 8))
    assert hf.generate(prompt, 16, gamma=3).token_ids == hf.generate(prompt, 16, gamma=None).token_ids


def test_init_continues_a_draft_keeping_its_vocabulary(target_dir, trained, tmp_path, capsys):
    # (a shape flag is overruled by the init's own shape, and the card says what was trained)
    assert _distill(target_dir, tmp_path / "more", "--steps", "1", "--draft-layers", "3", "--init", str(trained[0])) == 0
    assert torch.equal(read_draft_vocab(tmp_path / "more", 10_000), read_draft_vocab(trained[0], 10_000))
    card = json.loads((tmp_path / "more" / "model_card.json").read_text())
    assert card["options"]["draft_layers"] == 1 and card["options"]["draft_hidden"] == 32
    assert "kept from" in (tmp_path / "more" / ".distill" / "log.txt").read_text()
    assert train_main(["distill", "--target", str(target_dir), "--data", "stdlib", "--stdlib-tokens", "3000",
                       "--out", str(tmp_path / "other"), "--draft-vocab", str(VOCAB - 10), "--steps", "1",
                       "--batch-size", "2", "--seq-len", "32", "--init", str(trained[0])]) == 2
    assert f"never shrinks: pass --draft-vocab {VOCAB} or more" in capsys.readouterr().err


def test_init_with_a_larger_vocabulary_keeps_its_tokens_and_adds_the_most_emitted(target_dir, trained, tmp_path):
    """Why: the shipped SmolLM2 draft's 8,192 tokens, chosen on code, cover 84 % of the target's everyday answers."""
    from duospec.training.eagle3 import choose_draft_vocab

    assert _distill(target_dir, tmp_path / "grown", "--steps", "2", "--init", str(trained[0]),
                    "--draft-vocab", str(VOCAB + 20)) == 0
    kept, grown = read_draft_vocab(trained[0], 10_000), read_draft_vocab(tmp_path / "grown", 10_000)
    assert len(grown) == VOCAB + 20 and torch.equal(grown, grown.sort().values)
    assert set(kept.tolist()) < set(grown.tolist())
    log = (tmp_path / "grown" / ".distill" / "log.txt").read_text()
    assert f"{VOCAB} kept from {trained[0]}, 20 added" in log
    # the added tokens are the most emitted of the rest: a fresh choice of VOCAB + 20 from the same counts
    # (the init's tokens ranked first) picks the same ones
    from duospec.training.features import FeatureCache
    counts = FeatureCache(tmp_path / "grown" / ".distill" / "features").emitted_token_weights(
        AutoModelForCausalLM.from_pretrained(target_dir).config.vocab_size)
    assert torch.equal(choose_draft_vocab(counts, VOCAB + 20, kept.tolist()), grown)
    # and it serves: the engine computes exactly the grown vocabulary's rows
    runner = load_model(tmp_path / "grown", device="cpu", dtype="float32", max_slots=1, drafter=True)
    assert torch.equal(runner.draft_ids, grown)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_grown_models_change_nothing_until_trained(family, tmp_path):
    """models.widen_mlp then models.deepen: the grown model's logits and its cached greedy decode are
    the original's, the new layers sit among the old ones, and each layer indexes its own KV cache slot."""
    from duospec.training.models import deepen, widen_mlp
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / family, family, num_layers=3)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    old = list(model.model.layers)
    ids = torch.tensor([[3, 9, 4, 11, 2, 8, 30]])
    with torch.no_grad():
        before, decoded = model(input_ids=ids).logits, model.generate(ids, max_new_tokens=8, do_sample=False)
        widen_mlp(model, 200, seed=0)
        deepen(model, 2, seed=0)
        assert all(layer.mlp.up_proj.weight.shape[0] == 200 for layer in model.model.layers)
        assert model.config.num_hidden_layers == len(model.model.layers) == 5
        assert [layer.self_attn.layer_idx for layer in model.model.layers] == list(range(5))
        assert [any(layer is o for o in old) for layer in model.model.layers] == [True, False, True, True, False]
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=1e-5)  # wider sums round apart
        assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), decoded)
        fresh = model.model.layers[1]
        assert fresh.self_attn.q_proj.weight.abs().sum() > 0 and not fresh.mlp.down_proj.weight.any()
    with pytest.raises(ValueError, match="at least one layer"):
        deepen(model, 0, seed=0)
    with pytest.raises(ValueError, match="not wider"):
        widen_mlp(model, 200, seed=0)


def test_add_layers_deepens_the_init_and_resumes(target_dir, trained, tmp_path):
    out = tmp_path / "deeper"
    grow = ("--init", str(trained[0]), "--add-layers", "2", "--mlp-width", "160")
    assert _distill(target_dir, out, "--steps", "1", *grow) == 0
    config = AutoModelForCausalLM.from_pretrained(str(out)).config
    assert (config.num_hidden_layers, config.intermediate_size) == (3, 160)
    card = json.loads((out / "model_card.json").read_text())
    assert card["options"]["draft_layers"] == 3 and card["options"]["add_layers"] == 2
    # the same command with a larger budget resumes the deepened run (the grown shape is its identity)
    assert _distill(target_dir, out, "--steps", "2", *grow) == 0
    assert "resumed from" in (out / ".distill" / "log.txt").read_text()
    assert json.loads((out / "model_card.json").read_text())["steps"] == 2


def test_init_share_writes_the_average_of_the_trained_weights_and_the_inits(target_dir, trained, tmp_path):
    out = tmp_path / "blend"
    init = AutoModelForCausalLM.from_pretrained(str(trained[0]), dtype=torch.float32).state_dict()

    def written(share: str) -> dict:
        assert _distill(target_dir, out, "--steps", "2", "--init", str(trained[0]), "--init-share", share) == 0
        return AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()

    as_init = written("1")
    assert all(torch.equal(as_init[name], init[name]) for name in init)
    as_trained = written("0")  # the finished run is only written again
    assert (out / ".distill" / "log.txt").read_text().count("resumed from") == 1
    moved = [name for name in init if not torch.equal(as_trained[name], init[name])]
    assert moved
    halfway = written("0.5")
    for name in moved:  # fp16 on disk: within a rounding step of the midpoint
        torch.testing.assert_close(halfway[name], (as_trained[name] + init[name]) / 2, rtol=2e-3, atol=2e-3)
    assert json.loads((out / "model_card.json").read_text())["options"]["init_share"] == 0.5


@pytest.mark.parametrize("case", ["minutes_without_vocab", "init_without_vocab", "vocab_with_init_layers",
                                  "text_files_with_vocab", "add_layers_without_init",
                                  "narrower_mlp", "share_without_init", "share_beyond_one"])
def test_bad_options_are_refused_before_training(case, target_dir, trained, tmp_path, capsys):
    base = ["distill", "--target", str(target_dir), "--out", str(tmp_path / "out"), "--batch-size", "2",
            "--seq-len", "32", "--device", "cpu"]
    extra, expected = {
        "minutes_without_vocab": (["--data", "stdlib", "--minutes", "1"], "--minutes needs --draft-vocab"),
        "init_without_vocab": (["--data", "stdlib", "--steps", "1", "--init", str(tmp_path)], "--init needs --draft-vocab"),
        "vocab_with_init_layers": (["--data", "stdlib", "--steps", "1", "--draft-vocab", "8", "--init-layers", "1"],
                                   "do not combine"),
        "text_files_with_vocab": (["--data", str(tmp_path), "--steps", "1", "--draft-vocab", "8"],
                                  "folders written by `duospec distill-data`"),
        "add_layers_without_init": (["--data", "stdlib", "--steps", "1", "--draft-vocab", "8", "--add-layers", "2"],
                                    "--add-layers and --mlp-width grow the --init draft"),
        "narrower_mlp": (["--data", "stdlib", "--steps", "1", "--draft-vocab", "8", "--init", str(trained[0]),
                          "--mlp-width", "8"], "not wider than"),
        "share_without_init": (["--data", "stdlib", "--steps", "1", "--draft-vocab", "8", "--init-share", "0.5"],
                               "--init-share averages the trained draft with its --init"),
        "share_beyond_one": (["--data", "stdlib", "--steps", "1", "--draft-vocab", "8", "--init", str(trained[0]),
                              "--init-share", "1.5"], "--init-share must be within [0, 1]"),
    }[case]
    assert train_main(base + extra) == 2
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize("case", ["missing_field", "out_of_range", "unsorted", "not_integers"])
def test_a_malformed_draft_vocabulary_is_refused_naming_the_file_and_field(target_dir, trained, tmp_path, case):
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree(trained[0], draft, ignore=shutil.ignore_patterns(".distill"))
    tensors, expected = {
        "missing_field": ({"ids": torch.arange(4)}, "no 'token_ids' tensor"),
        "out_of_range": ({"token_ids": torch.tensor([1, 2, 10_000_000])}, "outside the model's vocabulary"),
        "unsorted": ({"token_ids": torch.tensor([5, 2, 9])}, "ascending and unique"),
        "not_integers": ({"token_ids": torch.tensor([1.0, 2.0])}, "1-D integer tensor"),
    }[case]
    save_file(tensors, str(draft / DRAFT_VOCAB_FILE))
    with pytest.raises(CheckpointError, match=expected) as err:
        load_model(draft, device="cpu", dtype="float32", max_slots=1, drafter=True)
    assert DRAFT_VOCAB_FILE in str(err.value)


def test_sampled_output_follows_the_target_distribution(target_dir, trained):
    """q is zero outside the draft vocabulary; the target's rule still gives its own distribution."""
    import collections

    from duospec.decoding import _request, stream_events
    from duospec.draft_worker.methods import build_proposer
    from duospec.draft_worker.proposer import DraftMethod, DraftSpec
    from duospec.engine import load_checkpoint
    from duospec.sampling import SamplingParams
    from exactness import chi_square_pvalue
    from test_decoding import _exact_two_token_distribution

    hf_target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    prompt = [5, 17, 42]
    joint = _exact_two_token_distribution(hf_target, prompt, SamplingParams(temperature=1.0, top_k=4, seed=0))
    n = 1200
    requests = [_request(prompt, 2, "pearl", SamplingParams(temperature=1.0, top_k=4, seed=700 + i), 2, True)
                for i in range(n)]
    target = load_checkpoint(target_dir, device="cpu", dtype="float32", max_slots=32)
    proposer = build_proposer(DraftSpec(DraftMethod.MODEL, path=str(trained[0])), str(target_dir), device="cpu",
                              dtype="float32", max_slots=32)
    results = stream_events(target, proposer, requests, gamma=2, max_batch_size=16)
    assert sum(results[r.request_id][-1].stats.drafted_tokens for r in requests) >= n
    counts = collections.Counter(tuple(t for e in results[r.request_id][:-1] for t in e.token_ids) for r in requests)
    assert set(counts) <= set(joint)
    p_value = chi_square_pvalue(joint, counts, n)
    assert p_value > 1e-3, f"sampled output with a trimmed draft does not follow p (p={p_value:.2e})"


def test_stdlib_named_again_takes_the_next_raw_code(target_dir):
    """`--data stdlib ANSWERS stdlib`: the second takes the windows after the first's, so a cache built
    on `stdlib ANSWERS` is a prefix of it and extends instead of rebuilding."""
    from transformers import AutoTokenizer

    from duospec.training.features import training_sequences

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    once = training_sequences(tokenizer, ["stdlib"], 2000, 64)
    twice = training_sequences(tokenizer, ["stdlib", "stdlib"], 2000, 64)
    assert twice[: len(once)] == once and len(twice) > len(once)
    second = twice[len(once):]
    assert sum(len(ids) for _, _, ids, _ in second) >= 2000
    assert not {key for key, *_ in once} & {key for key, *_ in second}
    whole = training_sequences(tokenizer, ["stdlib"], 8000, 64)  # the next windows: nothing skipped
    assert whole[: len(twice)] == twice
