"""Head drafters (EAGLE, Medusa) on the target's hidden states: the engine, the wire, the drafter,
exactness in-process and through the server, and `duospec train-heads`.

Heads here have random weights (they mostly miss: the rejection paths) unless a test trains one;
tests/engine/test_bundled_heads.py runs the trained heads of the bundled target (mostly hits)."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from duospec.decoding import _request, stream_events
from duospec.draft_worker.methods import build_proposer
from duospec.draft_worker.proposer import DraftMethod, DraftSpec
from duospec.engine import CheckpointError, SlotChunk, load_checkpoint
from duospec.engine.heads import (EagleRunner, MedusaHeads, eagle_layer_config, load_eagle, load_medusa,
                                  read_target_io, write_head)
from duospec.internal.features_wire import features_from_proto, features_to_proto
from duospec.internal.v1 import pearl_pb2 as pb
from duospec.sampling import SamplingParams
from duospec.target_worker.verifier import Verifier
from duospec.training.heads import EagleTrainHead
from exactness import assert_greedy_equal, chi_square_pvalue, hf_greedy
from tiny_models import make_tiny_checkpoint

N_PROMPTS, N_NEW = 20, 64


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("heads") / "target", "llama", seed=21, hidden_size=64,
                                num_layers=2)


@pytest.fixture(scope="module")
def hf_target(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def target(target_dir):
    torch.set_num_threads(1)
    return load_checkpoint(target_dir, device="cpu", dtype="float32", max_slots=32)


def _rounded(module: torch.nn.Module) -> torch.nn.Module:
    """Weights rounded to fp16 (what a head directory stores), so both sides hold the same numbers."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.half().float())
    return module


@pytest.fixture(scope="module")
def eagle_head(target_dir, tmp_path_factory):
    io = read_target_io(target_dir)
    torch.manual_seed(3)
    head = _rounded(EagleTrainHead(eagle_layer_config(io.config)).eval())
    out = tmp_path_factory.mktemp("eagle") / "head"
    write_head(out, "eagle", io, head.export())
    return out, head


@pytest.fixture(scope="module")
def medusa_dir(target_dir, tmp_path_factory):
    io = read_target_io(target_dir)
    torch.manual_seed(4)
    heads = MedusaHeads(io.config.hidden_size, 3)
    with torch.no_grad():
        for block in heads.blocks:  # random, not the identity start: the heads guess something else
            block.weight.normal_(0, 0.5)
    out = tmp_path_factory.mktemp("medusa") / "head"
    write_head(out, "medusa", io, _rounded(heads).state_dict(), medusa_heads=3)
    return out


def _prompts(n=N_PROMPTS, vocab=384, seed=9) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (int(torch.randint(3, 14, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


# -- engine ----------------------------------------------------------------------------------------
def test_target_hidden_states_equal_transformers(target, hf_target):
    runner = target.runner
    slot = runner.allocate_slot()
    try:
        tokens = _prompts(1)[0] + [7, 8, 9]
        logits, hidden = runner.forward_with_hidden([SlotChunk(slot, 0, tokens)])
        with torch.no_grad():
            expected = hf_target.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]
        assert hidden[0].shape == expected.shape
        assert torch.allclose(hidden[0], expected, atol=1e-4)
        assert torch.allclose(logits[0], hf_target.lm_head(expected).float(), atol=1e-4)
    finally:
        runner.free_slot(slot)


def test_eagle_runner_equals_the_training_head(target_dir, hf_target, eagle_head):
    path, head = eagle_head
    runner = load_eagle(path, target_dir, dtype=torch.float32, max_slots=2)
    assert isinstance(runner, EagleRunner)
    tokens = _prompts(1, seed=3)[0] + [11, 12, 13, 14]
    with torch.no_grad():
        features = hf_target.model(input_ids=torch.tensor([tokens])).last_hidden_state
        embeds = hf_target.model.embed_tokens(torch.tensor([tokens]))
        prev = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)
        expected = head(embeds, prev)[0]  # [n, H]
    slot = runner.allocate_slot()
    split = len(tokens) - 3  # a prompt chunk, then rows one at a time (the drafter's steps)
    logits, predicted = runner.forward_eagle([SlotChunk(slot, 0, tokens[:split])], prev[0, :split])
    assert torch.allclose(predicted, expected[:split], atol=1e-4)
    assert torch.allclose(logits[0], hf_target.lm_head(expected[split - 1]).float(), atol=1e-4)
    for j in range(split, len(tokens)):
        _, row = runner.forward_eagle([SlotChunk(slot, j, [tokens[j]])], prev[0, j: j + 1])
        assert torch.allclose(row[0], expected[j], atol=1e-4)


def test_heads_refuse_another_target(eagle_head, medusa_dir, tmp_path):
    other = make_tiny_checkpoint(tmp_path / "other", "llama", seed=99, hidden_size=64, num_layers=2)
    with pytest.raises(CheckpointError, match="trained for another checkpoint"):
        load_eagle(eagle_head[0], other)
    with pytest.raises(CheckpointError, match="trained for another checkpoint"):
        load_medusa(medusa_dir, other)
    wider = make_tiny_checkpoint(tmp_path / "wider", "llama", seed=21, hidden_size=128, num_layers=2)
    with pytest.raises(CheckpointError, match="hidden size 64"):
        load_eagle(eagle_head[0], wider)
    with pytest.raises(CheckpointError, match="holds a eagle head"):
        load_medusa(eagle_head[0], other)
    with pytest.raises(CheckpointError, match="no head.json"):
        load_eagle(tmp_path, other)


# -- the wire and the verifier ---------------------------------------------------------------------
def test_features_round_trip_as_fp16():
    rows = torch.randn(5, 64)
    msg = features_to_proto(7, rows)
    assert len(msg.fp16) == 5 * 64 * 2  # bytes per committed token = 2 x hidden size
    start, back = features_from_proto(pb.Features.FromString(msg.SerializeToString()))
    assert start == 7 and torch.allclose(back, rows.half().float())
    with pytest.raises(ValueError, match="whole number"):
        features_from_proto(pb.Features(start_pos=0, hidden_size=64, fp16=b"\0" * 10))


def test_verifier_sends_features_of_committed_positions_only(target, hf_target):
    verifier = Verifier(target.runner)
    prompt = _prompts(1, seed=5)[0]
    greedy = hf_greedy(hf_target, prompt, 3)
    wrong = (greedy[1] + 1) % 300 + 4
    item = pb.VerifyItem(seq_id=1, epoch=0, start_pos=0, context=prompt, draft_tokens=[greedy[0], wrong, 5],
                         sampling=pb.Sampling(), features=True)
    verdict = verifier.run(pb.VerifyBatch(batch_id=1, items=[item])).verdicts[0]
    assert verdict.n_accepted == 1 and verdict.next_token == greedy[1]
    start, rows = features_from_proto(verdict.features)
    assert start == 0 and rows.shape[0] == len(prompt) + 1  # the context + the accepted draft, not the rest
    with torch.no_grad():
        expected = hf_target.model(input_ids=torch.tensor([prompt + greedy[:1]])).last_hidden_state[0]
    assert torch.allclose(rows, expected, atol=1e-2)  # fp16 on the wire
    with_logprobs = pb.VerifyItem(seq_id=3, epoch=0, start_pos=0, context=prompt, draft_tokens=[greedy[0]],
                                  sampling=pb.Sampling(), features=True, logprobs=True, top_logprobs=2)
    both = verifier.run(pb.VerifyBatch(batch_id=3, items=[with_logprobs]))
    assert not both.errors and len(both.verdicts[0].logprobs) == 2 and both.verdicts[0].HasField("features")
    plain = pb.VerifyItem(seq_id=2, epoch=0, start_pos=0, context=prompt, sampling=pb.Sampling())
    assert not verifier.run(pb.VerifyBatch(batch_id=2, items=[plain])).verdicts[0].HasField("features")
    verifier.release_all()


# -- exactness in-process --------------------------------------------------------------------------
def _specs(eagle_head, medusa_dir):
    return {"eagle": DraftSpec(DraftMethod.EAGLE, path=str(eagle_head[0])),
            "medusa": DraftSpec(DraftMethod.MEDUSA, path=str(medusa_dir))}


def _tokens(events):
    return [t for e in events[:-1] for t in e.token_ids]


@pytest.mark.parametrize("method", ["eagle", "medusa"])
@pytest.mark.parametrize("mode", ["pearl", "vanilla"])
def test_greedy_in_process_matches_target_alone(target, target_dir, hf_target, eagle_head, medusa_dir, method, mode,
                                                caplog):
    proposer = build_proposer(_specs(eagle_head, medusa_dir)[method], str(target_dir), device="cpu",
                              dtype="float32", max_slots=32)
    prompts = _prompts()
    requests = [_request(p, N_NEW, mode, SamplingParams(), 4, True) for p in prompts]
    events = stream_events(target, proposer, requests)
    drafted = 0
    for prompt, req in zip(prompts, requests):
        assert_greedy_equal(hf_target, prompt, _tokens(events[req.request_id]), hf_greedy(hf_target, prompt, N_NEW))
        drafted += events[req.request_id][-1].stats.drafted_tokens
    assert drafted >= N_PROMPTS * 4, f"{method}/{mode}: the head hardly drafted ({drafted})"
    assert "draft step failed" not in caplog.text  # (a failed step only drops drafting: exact, but a bug)


def test_eagle_sampling_follows_the_target_distribution(target, target_dir, hf_target, eagle_head):
    from test_decoding import _exact_two_token_distribution

    prompt = [5, 17, 42]
    params = SamplingParams(temperature=1.0, top_k=4, seed=0)
    joint = _exact_two_token_distribution(hf_target, prompt, params)
    n = 1500
    spec = DraftSpec(DraftMethod.EAGLE, path=str(eagle_head[0]))
    for mode in ("pearl", "vanilla"):
        requests = [_request(prompt, 2, mode, SamplingParams(temperature=1.0, top_k=4, seed=700 + i), 2, True)
                    for i in range(n)]
        proposer = build_proposer(spec, str(target_dir), device="cpu", dtype="float32", max_slots=32)
        results = stream_events(target, proposer, requests, gamma=2, max_batch_size=16)
        assert sum(results[r.request_id][-1].stats.drafted_tokens for r in requests) >= n
        counts = collections.Counter(tuple(_tokens(results[r.request_id])) for r in requests)
        assert set(counts) <= set(joint)
        p_value = chi_square_pvalue(joint, counts, n)
        assert p_value > 1e-3, f"{mode}: EAGLE-drafted sampled output does not follow p (p={p_value:.2e})"


def test_eagle_seeded_sampling_repeats_alone_and_under_load(target, target_dir, eagle_head):
    spec = DraftSpec(DraftMethod.EAGLE, path=str(eagle_head[0]))

    def proposer():
        return build_proposer(spec, str(target_dir), device="cpu", dtype="float32", max_slots=32)

    params = SamplingParams(temperature=0.9, top_p=0.95, seed=77)
    prompt = _prompts(1, seed=11)[0]
    alone = []
    for _ in range(2):
        req = _request(prompt, 48, "pearl", params, 4, True)
        events = stream_events(target, proposer(), [req])[req.request_id]
        assert events[-1].stats.drafted_tokens > 0
        alone.append(_tokens(events))
    assert alone[0] == alone[1]
    crowd = [_request(prompt, 48, "pearl", params, 4, True)] + [
        _request(p, 48, "pearl", SamplingParams(temperature=0.9, seed=i), 4, True) for i, p in enumerate(_prompts(7))]
    loaded = stream_events(target, proposer(), crowd)
    assert _tokens(loaded[crowd[0].request_id]) == alone[0]


def test_medusa_declines_sampled_requests_which_go_on_target_only(target, target_dir, medusa_dir):
    proposer = build_proposer(DraftSpec(DraftMethod.MEDUSA, path=str(medusa_dir)), str(target_dir))
    req = _request(_prompts(1)[0], 24, "pearl", SamplingParams(temperature=0.8, seed=3), 4, True)
    events = stream_events(target, proposer, [req])[req.request_id]
    assert len(_tokens(events)) == 24 and events[-1].stats.drafted_tokens == 0


# -- through the server ----------------------------------------------------------------------------
async def test_greedy_through_the_server_with_head_drafters(target_dir, hf_target, eagle_head, medusa_dir):
    from duospec.coordinator.api import SpeculationMode
    from duospec.coordinator.config import ModelConfig, SpeculationDefaults
    from duospec.coordinator.local import LocalCoordinator
    from duospec.v1 import generation_pb2 as gpb
    from server_support import collect, running_server

    specs = _specs(eagle_head, medusa_dir)
    configs = [ModelConfig(name=f"tiny-{m}", target=str(target_dir), draft=spec, device="cpu", dtype="float32",
                           speculation=SpeculationDefaults(mode=SpeculationMode.PEARL, max_draft_tokens=4,
                                                           max_lookahead=9, adaptive=False))
               for m, spec in specs.items()]
    async with running_server(LocalCoordinator(configs)) as h:
        cards = {c.name: c.draft_method for c in (await h.stub.ListModels(gpb.ListModelsRequest())).models}
        assert cards == {"tiny-eagle": "eagle", "tiny-medusa": "medusa"}
        for method in specs:
            for mode in (gpb.SPECULATION_MODE_PEARL, gpb.SPECULATION_MODE_VANILLA):
                for prompt in _prompts(6, seed=13):
                    req = gpb.GenerateRequest(
                        model=f"tiny-{method}", prompt_token_ids=gpb.TokenIds(ids=prompt),
                        stopping=gpb.StoppingCriteria(max_new_tokens=32, ignore_eos=True),
                        speculation=gpb.SpeculationParams(mode=mode))
                    got = [t for m in await collect(h.stub, req) for t in m.token_ids]
                    assert_greedy_equal(hf_target, prompt, got, hf_greedy(hf_target, prompt, 32))


# -- training ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_train_heads_writes_a_servable_head_and_resumes(target_dir, tmp_path, method):
    import sysconfig

    from duospec.cli.train import main

    data = [str(sysconfig.get_paths()["stdlib"] + name) for name in ("/textwrap.py", "/shlex.py")]
    out = tmp_path / method

    def args(steps):
        return ["train-heads", "--target", str(target_dir), "--method", method, "--data", *data, "--out", str(out),
                "--steps", str(steps), "--batch-size", "2", "--seq-len", "32", "--eval-prompts", "2",
                "--medusa-heads", "2"]

    assert main(args(4)) == 0
    card = json.loads((out / "head.json").read_text())["card"]
    assert card["steps"] == 4 and card["heldout_mean_accepted_length"] >= 1.0
    assert [k["mean_accepted_length"] >= 1.0 and k["prompts"] > 0 for k in card["heldout_acceptance"].values()] == [True]
    loader = load_eagle if method == "eagle" else load_medusa
    loader(out, target_dir)  # the fingerprint matches the target it was trained on
    assert main(args(6) + ["--bf16"]) == 0  # a larger budget resumes and extends, here under bf16 autocast
    resumed = json.loads((out / "head.json").read_text())["card"]
    assert resumed["steps"] == 6 and resumed["options"]["bf16"] is True
    assert "resumed from" in (out / ".train-heads" / "log.txt").read_text()


def test_train_heads_reports_bad_input(target_dir, tmp_path, capsys):
    from duospec.cli.train import main

    assert main(["train-heads", "--target", str(target_dir), "--method", "eagle", "--data", str(tmp_path),
                 "--out", str(tmp_path / "o")]) == 2
    assert "--steps N or --minutes M" in capsys.readouterr().err
    assert main(["train-heads", "--target", str(tmp_path / "missing"), "--method", "eagle", "--data", "stdlib",
                 "--out", str(tmp_path / "o"), "--steps", "1"]) == 2
    assert "--target" in capsys.readouterr().err


# -- through the Ray actors --------------------------------------------------------------------------
@pytest.mark.ray
def test_greedy_through_actors_with_head_drafters(ray_runtime, target_dir, hf_target, eagle_head, medusa_dir):
    from duospec.coordinator.api import SpeculationMode
    from duospec.coordinator.config import ModelConfig, SpeculationDefaults
    from duospec.coordinator.pipeline import start_pipeline
    from pipeline_support import BackgroundLoop, request, run_all

    specs = _specs(eagle_head, medusa_dir)
    configs = [ModelConfig(name=f"tiny-{m}", target=str(target_dir), draft=spec, device="cpu", dtype="float32",
                           speculation=SpeculationDefaults(mode=SpeculationMode.PEARL, max_draft_tokens=4,
                                                           max_lookahead=9, adaptive=False))
               for m, spec in specs.items()]
    loop = BackgroundLoop()
    coordinator = start_pipeline(configs)
    try:
        for method in specs:
            assert coordinator.pairs[f"tiny-{method}"].draft_info["draft_method"] == method
            prompts = _prompts(8, seed=17)
            for mode in ("pearl", "vanilla"):
                results = loop.run(run_all(coordinator, [request(p, 48, mode, model=f"tiny-{method}") for p in prompts]))
                for prompt, result in zip(prompts, results):
                    assert_greedy_equal(hf_target, prompt, result.tokens, hf_greedy(hf_target, prompt, 48))
                assert sum(r.stats.drafted_tokens for r in results) > 0
    finally:
        loop.run(coordinator.close())
        loop.close()


def test_a_target_without_hidden_states_sends_head_sequences_on_target_only(target_dir, hf_target, eagle_head):
    """The transformers fallback backend returns no hidden states: the sequence must not stall
    waiting for features; it goes on target-only with the target's exact output."""
    hf_backend = load_checkpoint(target_dir, device="cpu", dtype="float32", max_slots=4, backend="hf")
    proposer = build_proposer(DraftSpec(DraftMethod.EAGLE, path=str(eagle_head[0])), str(target_dir))
    prompt = _prompts(1, seed=21)[0]
    for mode in ("pearl", "vanilla"):
        req = _request(prompt, 16, mode, SamplingParams(), 4, True)
        events = stream_events(hf_backend, proposer, [req])[req.request_id]
        assert_greedy_equal(hf_target, prompt, _tokens(events), hf_greedy(hf_target, prompt, 16))
        assert events[-1].stats.drafted_tokens == 0


def test_feature_store_rows_and_gaps():
    from duospec.draft_worker.proposer import FeatureStore

    store = FeatureStore()
    store.write(0, torch.ones(3, 4))
    store.write(2, torch.full((100, 4), 2.0))  # overlaps and grows past the first capacity
    assert store.known == 102 and store.row(1).tolist() == [1.0] * 4 and store.row(2).tolist() == [2.0] * 4
    tail = store.tail(1, 3)  # what a hedge keeps: rows 1 and 2 only
    assert (tail.base, tail.known) == (1, 3) and tail.row(2).tolist() == [2.0] * 4
    with pytest.raises(IndexError):
        tail.row(0)
    store.truncate(1)
    assert store.known == 1 and not store.broken
    tail.write(0, torch.full((4, 4), 3.0))  # rows below a tail's base are dropped, the rest written
    assert (tail.base, tail.known) == (1, 4) and tail.row(1).tolist() == [3.0] * 4
    store.write(5, torch.ones(1, 4))  # a gap: the store can never be complete again
    assert store.broken and store.known == 1


def test_medusa_on_a_one_token_prompt(target, target_dir, hf_target, medusa_dir):
    proposer = build_proposer(DraftSpec(DraftMethod.MEDUSA, path=str(medusa_dir)), str(target_dir))
    others = _prompts(3, seed=23)
    requests = [_request(p, 16, "pearl", SamplingParams(), 4, True) for p in [[9], *others]]
    events = stream_events(target, proposer, requests)
    for prompt, req in zip([[9], *others], requests):  # the short one must not take the others down
        assert_greedy_equal(hf_target, prompt, _tokens(events[req.request_id]), hf_greedy(hf_target, prompt, 16))
    assert all(events[r.request_id][-1].stats.drafted_tokens > 0 for r in requests[1:])


def test_prefill_chunks_too_big_for_one_message_are_refused(target_dir, eagle_head):
    from duospec.coordinator.config import ModelConfig
    from duospec.coordinator.models import ModelPairError, model_info

    spec = DraftSpec(DraftMethod.EAGLE, path=str(eagle_head[0]))
    model_info(ModelConfig(name="ok", target=str(target_dir), draft=spec, prefill_chunk_tokens=4096))
    with pytest.raises(ModelPairError, match="prefill_chunk_tokens 1000000"):
        model_info(ModelConfig(name="big", target=str(target_dir), draft=spec, prefill_chunk_tokens=1_000_000))


def test_simulation_records_the_eagle_heads_choices(target_dir, hf_target, eagle_head):
    from duospec.bench.simulate import record_tables
    from duospec.training.heads import draft_tokens

    prompts = _prompts(2, seed=31)
    entries = record_tables(str(target_dir), str(eagle_head[0]), prompts, 6, 3, progress=False, draft_method="eagle")
    _, head = eagle_head
    for prompt, entry in zip(prompts, entries):
        assert list(entry.greedy[:6]) == hf_greedy(hf_target, prompt, 6)
        sequence = torch.tensor([list(prompt) + list(entry.greedy)])
        with torch.no_grad():
            features = hf_target.model(input_ids=sequence).last_hidden_state
            for j in (0, 4):  # after the prompt, and after 4 generated tokens
                expected, second = draft_tokens(hf_target, head, "eagle", sequence, features, len(prompt) + j, 3,
                                                with_second=True)
                assert list(entry.drafts[j]) == expected and entry.seconds[j] == second
