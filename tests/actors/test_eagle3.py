"""EAGLE-3 heads (duospec/engine/eagle3.py): the target's three-layer features, the head on the engine
against its training module, both layouts, refusals, exactness in-process (Llama and Qwen2 targets,
greedy and sampled) and through the actors and the server, the feature cache and resumable training.

Heads here have random weights, with a draft vocabulary of a third of the target's: they mostly miss,
and tokens outside the draft vocabulary can only come from the target's corrections."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from duospec.decoding import _request, stream_events
from duospec.draft_worker.methods import build_proposer
from duospec.draft_worker.proposer import DraftMethod, DraftSpec
from duospec.engine import CheckpointError, SlotChunk, load_checkpoint
from duospec.engine.eagle3 import Eagle3Runner, default_feature_layers, load_eagle3, write_published
from duospec.engine.heads import eagle_layer_config, read_target_io, write_head
from duospec.sampling import SamplingParams
from duospec.training.eagle3 import Eagle3TrainHead
from exactness import assert_greedy_equal, chi_square_pvalue, hf_greedy
from tiny_models import make_tiny_checkpoint

N_PROMPTS, N_NEW = 12, 40
LAYERS = 4


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, family):
    return make_tiny_checkpoint(tmp_path_factory.mktemp(f"eagle3-{family}") / "target", family, seed=23,
                                hidden_size=64, num_layers=LAYERS)


@pytest.fixture(scope="module")
def hf_target(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def target(target_dir):
    torch.set_num_threads(1)
    runner = load_checkpoint(target_dir, device="cpu", dtype="float32", max_slots=32)
    runner.runner.set_feature_layers(default_feature_layers(LAYERS))
    return runner


def random_head(target_dir, seed: int = 5) -> Eagle3TrainHead:
    """A random head over every third token, weights rounded to fp16 as a head directory stores them."""
    io = read_target_io(target_dir)
    torch.manual_seed(seed)
    head = Eagle3TrainHead(eagle_layer_config(io.config), torch.arange(0, io.config.vocab_size, 3)).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_((p + 0.1 * torch.randn_like(p)).half().float())
    return head


def write_duospec(out, target_dir, head: Eagle3TrainHead):
    io = read_target_io(target_dir)
    write_head(out, "eagle3", io, head.export(), extra={"eagle3": {
        "feature_layers": list(default_feature_layers(LAYERS)), "draft_vocab_size": len(head.draft_ids)}})
    return out


@pytest.fixture(scope="module")
def heads(target_dir, tmp_path_factory):
    """(duospec-layout dir, published-layout dir, the training module) of one random head."""
    head = random_head(target_dir)
    root = tmp_path_factory.mktemp("eagle3-heads")
    write_published(root / "published", read_target_io(target_dir), head.export(), default_feature_layers(LAYERS))
    return write_duospec(root / "ours", target_dir, head), root / "published", head


def _prompts(n=N_PROMPTS, vocab=384, seed=9) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (int(torch.randint(3, 14, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def _tokens(events):
    return [t for e in events[:-1] for t in e.token_ids]


def _features(hf_target, tokens):
    with torch.no_grad():
        out = hf_target.model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in default_feature_layers(LAYERS)], -1)[0]


# -- engine --------------------------------------------------------------------------------------------
def test_target_taps_equal_transformers_hidden_states(target, hf_target):
    slot = target.runner.allocate_slot()
    try:
        tokens = _prompts(1)[0] + [7, 8, 9]
        logits, taps = target.runner.forward_with_hidden([SlotChunk(slot, 0, tokens)])
        assert taps[0].shape == (len(tokens), 3 * 64)
        assert torch.allclose(taps[0], _features(hf_target, tokens), atol=1e-4)
        with torch.no_grad():  # the logits are still the target's own
            assert torch.allclose(logits[0], hf_target(input_ids=torch.tensor([tokens])).logits[0], atol=1e-4)
    finally:
        target.runner.free_slot(slot)
    with pytest.raises(CheckpointError, match="out of range"):
        target.runner.set_feature_layers((0, LAYERS))


def test_runner_equals_the_training_head_in_both_layouts(target_dir, hf_target, heads):
    ours, published, head = heads
    tokens = _prompts(1, seed=3)[0] + [11, 12, 13, 14]
    features = _features(hf_target, tokens)
    prev = torch.cat([torch.zeros_like(features[:1]), features[:-1]])
    with torch.no_grad():
        embeds = hf_target.model.embed_tokens(torch.tensor([tokens]))
        expected = head.unrolled(embeds, prev[None], 1)[0][0]
    drafted = {}
    for path in (ours, published):
        runner = load_eagle3(path, target_dir, max_slots=2)
        assert isinstance(runner, Eagle3Runner)
        slot = runner.allocate_slot()
        split = len(tokens) - 3  # a prompt chunk, then rows one at a time (the drafter's steps)
        logits, out = runner.forward_eagle([SlotChunk(slot, 0, tokens[:split])], runner.project(prev[:split]))
        assert torch.allclose(out, expected[:split], atol=1e-4)
        small = head.logits(expected[split - 1])
        assert torch.allclose(logits[0][head.draft_ids], small, atol=1e-4)
        outside = torch.ones(logits.shape[-1], dtype=torch.bool)
        outside[head.draft_ids] = False
        assert torch.isinf(logits[0][outside]).all()  # q is zero outside the draft vocabulary
        rows = [logits[0]]
        for j in range(split, len(tokens)):
            step, row = runner.forward_eagle([SlotChunk(slot, j, [tokens[j]])], runner.project(prev[j: j + 1]))
            assert torch.allclose(row[0], expected[j], atol=1e-4)
            rows.append(step[0])
        drafted[path] = torch.stack(rows)
    assert torch.equal(drafted[ours], drafted[published])  # the published layout drafts exactly the same


def test_malformed_heads_are_refused_naming_file_and_field(target_dir, heads, tmp_path):
    from safetensors.torch import load_file, save_file

    _, published, _ = heads

    def broken(name, edit_weights=None, edit_config=None):
        out = tmp_path / name
        out.mkdir()
        weights = load_file(str(published / "model.safetensors"))
        config = json.loads((published / "config.json").read_text())
        if edit_weights:
            edit_weights(weights)
        if edit_config:
            edit_config(config)
        save_file(weights, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(config))
        return out

    no_d2t = broken("no-d2t", edit_weights=lambda w: w.pop("d2t"))
    with pytest.raises(CheckpointError, match=r"no-d2t/model.safetensors: tensor 'd2t' missing"):
        load_eagle3(no_d2t, target_dir)
    wide = broken("wide", edit_config=lambda c: c.update(hidden_size=128))
    with pytest.raises(CheckpointError, match=r"wide: hidden_size 128, but the target's is 64"):
        load_eagle3(wide, target_dir)
    vocab = broken("vocab", edit_config=lambda c: c.update(vocab_size=999))
    with pytest.raises(CheckpointError, match=r"vocab: vocab_size 999, but the target's vocabulary"):
        load_eagle3(vocab, target_dir)
    fc = broken("fc", edit_weights=lambda w: w.update({"fc.weight": w["fc.weight"][:, :128].contiguous()}))
    with pytest.raises(CheckpointError, match=r"fc/model.safetensors: fc.weight is \[64, 128\]"):
        load_eagle3(fc, target_dir)
    no_layer = broken("no-layer", edit_weights=lambda w: w.pop("midlayer.hidden_norm.weight"))
    with pytest.raises(CheckpointError, match="'midlayer.hidden_norm.weight' missing"):
        load_eagle3(no_layer, target_dir)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_eagle3(tmp_path / "nowhere", target_dir)


# -- exactness in-process --------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["pearl", "vanilla"])
def test_greedy_in_process_matches_target_alone(target, target_dir, hf_target, heads, mode, caplog):
    ours, _, head = heads
    proposer = build_proposer(DraftSpec(DraftMethod.EAGLE3, path=str(ours)), str(target_dir), device="cpu",
                              dtype="float32", max_slots=32)
    prompts = _prompts()
    requests = [_request(p, N_NEW, mode, SamplingParams(), 4, True) for p in prompts]
    events = stream_events(target, proposer, requests)
    drafted, outside = 0, 0
    in_vocab = set(head.draft_ids.tolist())
    for prompt, req in zip(prompts, requests):
        got = _tokens(events[req.request_id])
        assert_greedy_equal(hf_target, prompt, got, hf_greedy(hf_target, prompt, N_NEW))
        drafted += events[req.request_id][-1].stats.drafted_tokens
        outside += sum(t not in in_vocab for t in got)
    assert drafted >= N_PROMPTS * 4, f"{mode}: the head hardly drafted ({drafted})"
    assert outside > 0  # tokens the head can never draft still come out, as the target's corrections
    assert "draft step failed" not in caplog.text


def test_sampling_follows_the_target_distribution(target, target_dir, hf_target, heads):
    from test_decoding import _exact_two_token_distribution

    prompt = [5, 17, 42]
    params = SamplingParams(temperature=1.0, top_k=4, seed=0)
    joint = _exact_two_token_distribution(hf_target, prompt, params)
    n = 1200
    spec = DraftSpec(DraftMethod.EAGLE3, path=str(heads[0]))
    requests = [_request(prompt, 2, "pearl", SamplingParams(temperature=1.0, top_k=4, seed=900 + i), 2, True)
                for i in range(n)]
    proposer = build_proposer(spec, str(target_dir), device="cpu", dtype="float32", max_slots=32)
    results = stream_events(target, proposer, requests, gamma=2, max_batch_size=16)
    assert sum(results[r.request_id][-1].stats.drafted_tokens for r in requests) >= n
    counts = collections.Counter(tuple(_tokens(results[r.request_id])) for r in requests)
    assert set(counts) <= set(joint)
    p_value = chi_square_pvalue(joint, counts, n)
    assert p_value > 1e-3, f"EAGLE-3-drafted sampled output does not follow p (p={p_value:.2e})"


# -- the feature cache and training ---------------------------------------------------------------------
def test_feature_cache_equals_a_fresh_forward(target_dir, hf_target, tmp_path):
    from duospec.training.features import FeatureCache, build_feature_cache

    sequences = [(f"s{i}", "stdlib", p + [7, 8, 9], 2) for i, p in enumerate(_prompts(6, seed=4))]
    layers = default_feature_layers(LAYERS)
    build_feature_cache(target_dir, tmp_path / "cache", sequences[:4], layers, fingerprint="x", batch_tokens=40,
                        log=lambda _: None)
    # Data added at the end extends the cache (at its layers, whatever the caller asks: None = any).
    lines = []
    cache = build_feature_cache(target_dir, tmp_path / "cache", sequences, None, fingerprint="x", batch_tokens=40,
                                log=lines.append)
    assert "extending the cache's 4 sequences to 6" in lines[0] and sum("features: " in x for x in lines) == 2
    again = FeatureCache(tmp_path / "cache")
    assert len(again.sequences) == 6 and again.feature_layers == layers
    for seq, (_, _, ids, _) in zip(cache.sequences, sequences):
        tokens, taps, final, mask = cache.window(seq, 64)
        assert tokens.tolist() == ids
        assert torch.allclose(taps.float(), _features(hf_target, ids), atol=2e-3)  # stored as float16
        with torch.no_grad():
            fresh = hf_target.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        assert torch.allclose(final.float(), fresh, atol=2e-3)
        assert mask.tolist() == [j >= 1 for j in range(len(ids) - 1)] + [False]
    for other in (sequences[:3], sequences[1:] + sequences[:1]):  # fewer sequences, or other data first
        with pytest.raises(ValueError, match="another target"):
            build_feature_cache(target_dir, tmp_path / "cache", other, layers, fingerprint="x", log=lambda _: None)


def test_train_eagle3_writes_a_servable_head_and_resumes_on_the_same_curve(target_dir, tmp_path, capsys):
    from duospec.cli.train import main

    def run(out, steps):
        assert main(["train-heads", "--target", str(target_dir), "--method", "eagle3", "--data", "stdlib",
                     "--stdlib-tokens", "3000", "--out", str(out), "--steps", str(steps), "--batch-size", "2",
                     "--seq-len", "32", "--eval-prompts", "2", "--draft-vocab", "200", "--layout", "published"]) == 0
        return json.loads((out / "head.json").read_text())["card"]

    straight = run(tmp_path / "straight", 6)
    run(tmp_path / "split", 3)
    resumed = run(tmp_path / "split", 6)
    assert resumed["steps"] == straight["steps"] == 6
    assert resumed["last_eval"] == pytest.approx(straight["last_eval"], rel=1e-4)  # the same curve
    assert resumed["draft_vocab"] == 200 and resumed["heldout_mean_accepted_length"] >= 1.0
    assert "resumed from" in (tmp_path / "split" / ".train-heads" / "log.txt").read_text()
    ours = load_eagle3(tmp_path / "split", target_dir)
    published = load_eagle3(tmp_path / "split" / "published", target_dir)
    assert torch.equal(ours.draft_ids, published.draft_ids)
    # --init continues from a written head (a shipped one) on other data, keeping its draft vocabulary
    assert main(["train-heads", "--target", str(target_dir), "--method", "eagle3", "--data", "stdlib",
                 "--stdlib-tokens", "5000", "--out", str(tmp_path / "more"), "--steps", "1", "--batch-size", "2",
                 "--seq-len", "32", "--eval-prompts", "1", "--draft-vocab", "200", "--init",
                 str(tmp_path / "split")]) == 0
    log = (tmp_path / "more" / ".train-heads" / "log.txt").read_text()
    assert "initialised from" in log and "kept from" in log
    assert torch.equal(load_eagle3(tmp_path / "more", target_dir).draft_ids, ours.draft_ids)
    assert main(["train-heads", "--target", str(target_dir), "--method", "eagle3", "--data", "stdlib",
                 "--stdlib-tokens", "5000", "--out", str(tmp_path / "other"), "--steps", "1", "--batch-size", "2",
                 "--seq-len", "32", "--draft-vocab", "300", "--init", str(tmp_path / "split")]) == 2
    assert "pass --draft-vocab 200" in capsys.readouterr().err


def test_draft_vocabulary_is_what_the_target_emits_most():
    from duospec.training.eagle3 import choose_draft_vocab, coverage

    counts = np.array([5, 0, 9, 1, 7, 0])
    ids = choose_draft_vocab(counts, 3, always=[5])
    assert ids.tolist() == [2, 4, 5]  # ascending; the end token kept even though never counted
    assert coverage(counts, ids) == pytest.approx(16 / 22)


# -- through the Ray actors --------------------------------------------------------------------------
@pytest.mark.ray
def test_greedy_through_actors(ray_runtime, target_dir, hf_target, heads):
    from duospec.coordinator.api import SpeculationMode
    from duospec.coordinator.config import ModelConfig, SpeculationDefaults
    from duospec.coordinator.pipeline import start_pipeline
    from pipeline_support import BackgroundLoop, request, run_all

    name = f"tiny-eagle3-{target_dir.parent.name}"
    config = ModelConfig(name=name, target=str(target_dir), draft=DraftSpec(DraftMethod.EAGLE3, path=str(heads[1])),
                         device="cpu", dtype="float32",
                         speculation=SpeculationDefaults(mode=SpeculationMode.PEARL, max_draft_tokens=4,
                                                         max_lookahead=9, adaptive=False))
    loop = BackgroundLoop()
    coordinator = start_pipeline([config])
    try:
        assert coordinator.pairs[name].draft_info["draft_method"] == "eagle3"
        prompts = _prompts(6, seed=17)
        for mode in ("pearl", "vanilla", "off"):
            results = loop.run(run_all(coordinator, [request(p, 32, mode, model=name) for p in prompts]))
            for prompt, result in zip(prompts, results):
                assert_greedy_equal(hf_target, prompt, result.tokens, hf_greedy(hf_target, prompt, 32))
            if mode != "off":
                assert sum(r.stats.drafted_tokens for r in results) > 0
    finally:
        loop.run(coordinator.close())
        loop.close()


@pytest.mark.ray
@pytest.mark.slow
async def test_greedy_through_the_server_at_tp_1_and_2(ray_runtime, target_dir, hf_target, heads):
    """Through the real gRPC server, every mode equals transformers with the target at TP=1 and TP=2
    (rank 0 taps the all-reduced residual stream; tests/engine/test_tensor_parallel.py checks the taps
    equal one process's), and the head drafts from the features the group sends."""
    import asyncio
    import dataclasses

    from duospec.coordinator.config import ServerSettings
    from duospec.coordinator.pipeline import start_pipeline
    from duospec.v1 import generation_pb2 as gpb
    from pipeline_support import model_config
    from server_support import collect, running_server

    settings = ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=0)
    prompts = _prompts(6, seed=31)
    modes = (gpb.SPECULATION_MODE_OFF, gpb.SPECULATION_MODE_VANILLA, gpb.SPECULATION_MODE_PEARL)
    for tp in (1, 2):
        name = f"eagle3-tp{tp}-{target_dir.parent.name}"
        config = dataclasses.replace(model_config(name, target_dir, None), tensor_parallel_size=tp, max_model_len=256,
                                     draft=DraftSpec(DraftMethod.EAGLE3, path=str(heads[0])))
        coordinator = start_pipeline([config])
        async with running_server(coordinator, settings) as h:
            runs = [(p, mode) for p in prompts for mode in modes]
            got = await asyncio.gather(*(collect(h.stub, gpb.GenerateRequest(
                prompt_token_ids=gpb.TokenIds(ids=p), stopping=gpb.StoppingCriteria(max_new_tokens=24, ignore_eos=True),
                speculation=gpb.SpeculationParams(mode=mode)), timeout=240) for p, mode in runs))
            for (prompt, _), messages in zip(runs, got):
                assert_greedy_equal(hf_target, prompt, [t for m in messages for t in m.token_ids],
                                    hf_greedy(hf_target, prompt, 24))
            drafted = sum(messages[-1].stats.drafted_tokens for (_, mode), messages in zip(runs, got)
                          if mode != gpb.SPECULATION_MODE_OFF)
            assert drafted >= len(prompts) * 4, f"TP={tp}: the head hardly drafted ({drafted})"
