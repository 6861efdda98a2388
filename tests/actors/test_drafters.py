"""Every drafting method keeps the target's output: in-process, through the Ray actors, through the server.

Methods: `ngram` (model-free), `layers` (the target's first layer of two, untrained as a draft, with the
model drafter's context lookup: draft_worker/context_lookup.py) and
`model` (a random-weight draft; through the actors and in-process it is covered by test_pipeline and
test_decoding, through the server here). The prompts mix random tokens
(the n-gram drafter mostly finds nothing: the EXHAUSTED path) with repeated phrases (it proposes, the
target accepts some and rejects some).
"""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest
import torch

from duospec.coordinator.api import FinishReason, SpeculationMode
from duospec.coordinator.config import ModelConfig, SpeculationDefaults
from duospec.draft_worker.methods import build_proposer
from duospec.draft_worker.proposer import DraftMethod, DraftSpec, NgramOptions
from duospec.decoding import _request, stream_events
from duospec.engine import load_checkpoint
from duospec.sampling import SamplingParams, probs_from_logits
from exactness import assert_greedy_equal, chi_square_pvalue, hf_greedy, reference_model
from pipeline_support import BackgroundLoop, request, run_all
from tiny_models import make_tiny_checkpoint

N_PROMPTS, N_NEW = 20, 64
NGRAM = DraftSpec(DraftMethod.NGRAM, ngram=NgramOptions(min_ngram=2, max_ngram=6))
LAYERS = DraftSpec(DraftMethod.LAYERS, layers=1)
SPECS = {"ngram": NGRAM, "layers": LAYERS}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("drafters") / "target", "llama", seed=11, hidden_size=64,
                                num_layers=2)


@pytest.fixture(scope="module")
def hf_target(target_dir):
    return reference_model(target_dir)


def _prompts(n=N_PROMPTS, vocab=384, seed=7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(n):
        if i % 2:
            prompts.append(rng.integers(4, vocab, size=int(rng.integers(3, 12))).tolist())
        else:  # a phrase said twice, then its start again: the n-gram drafter has something to copy
            phrase = rng.integers(4, vocab, size=int(rng.integers(4, 9))).tolist()
            prompts.append(phrase + rng.integers(4, vocab, size=3).tolist() + phrase + phrase[:2])
    return prompts


def _config(name, target_dir, spec, mode="pearl") -> ModelConfig:
    return ModelConfig(name=name, target=str(target_dir), draft=spec, device="cpu", dtype="float32",
                       speculation=SpeculationDefaults(mode=SpeculationMode(mode), max_draft_tokens=4,
                                                       max_lookahead=9, adaptive=False))


def _check_greedy(hf_target, prompts, results, mode):
    drafted = accepted = 0
    for prompt, result in zip(prompts, results):
        assert result.finish.finish_reason is FinishReason.LENGTH
        assert_greedy_equal(hf_target, prompt, result.tokens, hf_greedy(hf_target, prompt, N_NEW))
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    assert drafted > 0, f"{mode}: nothing was drafted; the path under test did not run"
    return drafted, accepted


# -- in-process ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(target_dir):
    torch.set_num_threads(1)
    return load_checkpoint(target_dir, device="cpu", dtype="float32", max_slots=32)


@pytest.mark.parametrize("method", ["ngram", "layers"])
@pytest.mark.parametrize("mode", ["pearl", "vanilla"])
def test_greedy_in_process_matches_target_alone(target, target_dir, hf_target, method, mode):
    proposer = build_proposer(SPECS[method], str(target_dir), device="cpu", dtype="float32", max_slots=32)
    prompts = _prompts()
    requests = [_request(p, N_NEW, mode, SamplingParams(), 4, True) for p in prompts]
    events = stream_events(target, proposer, requests)
    results = [_as_result(events[r.request_id]) for r in requests]
    drafted, accepted = _check_greedy(hf_target, prompts, results, mode)
    assert 0 < accepted < drafted  # both verdicts happened: some accepted, some rejected
    if method == "layers":  # the untrained draft is unsure: the context lookup's copies were drafted too
        assert proposer.stats()["lookup_used"] > 0


def _as_result(events):
    import types

    finish = events[-1]
    tokens = [t for e in events[:-1] for t in e.token_ids]
    return types.SimpleNamespace(tokens=tokens, finish=finish, stats=finish.stats)


def _prompt_with_likely_repeat(hf_target, params):
    """A prompt "a b c d ... a b" where c is a likely next token: the n-gram proposal (c, then d)
    is sometimes accepted and sometimes rejected — both branches of the sampled verify rule."""
    with torch.no_grad():
        for c in range(4, 384):
            prompt = [5, 17, c, 9, 30, 5, 17]
            p = probs_from_logits(hf_target(torch.tensor([prompt])).logits[0, -1:].float(), params)[0]
            if 0.2 < float(p[c]) < 0.8:
                return prompt
    raise AssertionError("no suitable prompt in this tiny model")


def test_ngram_sampling_follows_the_target_distribution(target, hf_target):
    from test_decoding import _exact_two_token_distribution

    params = SamplingParams(temperature=1.0, top_k=4, seed=0)
    prompt = _prompt_with_likely_repeat(hf_target, params)
    joint = _exact_two_token_distribution(hf_target, prompt, params)
    n = 1500
    for mode in ("pearl", "vanilla"):
        requests = [_request(prompt, 2, mode, SamplingParams(temperature=1.0, top_k=4, seed=500 + i), 2, True)
                    for i in range(n)]
        results = stream_events(target, build_proposer(NGRAM, ""), requests, gamma=2, max_batch_size=16)
        finals = [results[r.request_id][-1] for r in requests]
        assert sum(f.stats.drafted_tokens for f in finals) > n // 2  # the proposal was really verified
        counts = collections.Counter(tuple(_as_result(results[r.request_id]).tokens) for r in requests)
        assert set(counts) <= set(joint)
        p_value = chi_square_pvalue(joint, counts, n)
        assert p_value > 1e-3, f"{mode}: n-gram sampled output does not follow p (chi-square p={p_value:.2e})"


def test_ngram_seeded_sampling_repeats_alone_and_under_load(target, hf_target):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=77)
    prompt = _prompts(1)[0]  # a repeated phrase: the n-gram drafter proposes
    runs = [
        _as_result(stream_events(target, build_proposer(NGRAM, ""), [req])[req.request_id])
        for req in (_request(prompt, 48, "pearl", params, 4, True) for _ in range(2))
    ]
    alone = [run.tokens for run in runs]
    assert alone[0] == alone[1] and runs[0].stats.drafted_tokens > 0
    crowd = [_request(prompt, 48, "pearl", params, 4, True)] + [
        _request(p, 48, "pearl", SamplingParams(temperature=0.9, seed=i), 4, True) for i, p in enumerate(_prompts(7))
    ]
    loaded = stream_events(target, build_proposer(NGRAM, ""), crowd)
    assert _as_result(loaded[crowd[0].request_id]).tokens == alone[0]


# -- through the Ray actors ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loop():
    background = BackgroundLoop()
    yield background
    background.close()


@pytest.mark.ray
@pytest.mark.parametrize("method", ["ngram", "layers"])
def test_greedy_through_actors_matches_target_alone(ray_runtime, loop, target_dir, hf_target, method):
    from duospec.coordinator.pipeline import start_pipeline

    coordinator = start_pipeline([_config(f"tiny-{method}", target_dir, SPECS[method])])
    try:
        pair = coordinator.pairs[f"tiny-{method}"]
        assert pair.draft_info["draft_method"] == method
        assert pair.draft_info["max_slots"] is (None if method == "ngram" else 16)  # ngram loads no model
        prompts = _prompts()
        for mode in ("pearl", "vanilla"):
            reqs = [request(p, N_NEW, mode, model=f"tiny-{method}") for p in prompts]
            _check_greedy(hf_target, prompts, loop.run(run_all(coordinator, reqs)), mode)
    finally:
        loop.run(coordinator.close())


# -- through the gRPC server ----------------------------------------------------------------------------
async def test_greedy_through_the_server_for_each_method(target_dir, hf_target, tmp_path):
    from duospec.coordinator.local import LocalCoordinator
    from duospec.v1 import generation_pb2 as pb
    from server_support import collect, running_server

    random_draft = make_tiny_checkpoint(tmp_path / "draft", "llama", seed=12, hidden_size=32, num_layers=1)
    specs = {**SPECS, "model": DraftSpec(DraftMethod.MODEL, path=str(random_draft))}
    configs = [_config(f"tiny-{m}", target_dir, spec) for m, spec in specs.items()]
    async with running_server(LocalCoordinator(configs)) as h:
        cards = {c.name: c for c in (await h.stub.ListModels(pb.ListModelsRequest())).models}
        assert {name: c.draft_method for name, c in cards.items()} == {f"tiny-{m}": m for m in specs}
        prompts = _prompts(seed=8)
        for method in specs:
            for mode in (pb.SPECULATION_MODE_PEARL, pb.SPECULATION_MODE_VANILLA):
                reqs = [pb.GenerateRequest(
                    model=f"tiny-{method}", prompt_token_ids=pb.TokenIds(ids=prompt),
                    stopping=pb.StoppingCriteria(max_new_tokens=N_NEW, ignore_eos=True),
                    speculation=pb.SpeculationParams(mode=mode),
                ) for prompt in prompts]
                drafted = 0  # the prompts run at once: batched as a server's load is
                for prompt, messages in zip(prompts, await asyncio.gather(*(collect(h.stub, r) for r in reqs))):
                    got = [t for m in messages for t in m.token_ids]
                    assert_greedy_equal(hf_target, prompt, got, hf_greedy(hf_target, prompt, N_NEW))
                    drafted += messages[-1].stats.drafted_tokens
                assert drafted > 0, (method, mode)


def test_the_speculation_cache_and_token_trees_keep_greedy_output_exact(target, target_dir, hf_target):
    """With the cache and trees on, the first-layer draft agrees often enough that verdicts take
    branches (a tree node: a draft's runner-up or a hedge; or a cache hit); every token still equals
    transformers' greedy output. How often a hedge's own drafted tokens get used depends on timing
    (a handful of times in this run): test_speculation_cache.py checks that path step by step."""
    proposer = build_proposer(LAYERS, str(target_dir), device="cpu", dtype="float32", max_slots=32)
    prompts = _prompts()
    requests = [_request(p, N_NEW, "pearl", SamplingParams(), 4, True) for p in prompts]
    events = stream_events(target, proposer, requests)
    results = [_as_result(events[r.request_id]) for r in requests]
    _check_greedy(hf_target, prompts, results, "pearl")
    totals = collections.Counter()
    for r in results:
        totals.update(cache_lookups=r.stats.cache_lookups, cache_hits=r.stats.cache_hits,
                      tree_nodes=r.stats.tree_nodes, tree_hits=r.stats.tree_hits)
    assert totals["cache_lookups"] > 0 and totals["tree_nodes"] > 0, totals
    assert totals["cache_hits"] + totals["tree_hits"] > 0, f"no branch was ever taken: {totals}"
