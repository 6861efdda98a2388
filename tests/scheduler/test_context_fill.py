"""Requests that fill the context: a request asking for exactly the room its prompt leaves in
`max_model_len` completes in every mode, with the output of `off`.

Near the end of the context a pearl round's token tree (the drafts' runners-up and the speculation
cache's hedges, verified beside the main chain) is bounded by the positions left, but its nodes take
one KV row each after the chain: the tree must also fit the rows left, or the target refuses the
round mid-stream (it did: "sequence reaches position 65, past the target's context of 64").
"""

from __future__ import annotations

import asyncio
import random

import pytest

from duospec.coordinator.api import SpeculationMode
from duospec.coordinator.config import ModelConfig, ServerSettings, SpeculationDefaults
from duospec.sampling import SamplingParams
from duospec.v1 import generation_pb2 as pb
from exactness import assert_greedy_equal, reference_model
from pipeline_support import request, run_one
from server_support import collect, running_server
from tiny_models import make_tiny_checkpoint

MAX_MODEL_LEN = 48
CASES = 200
AT_ONCE = 8  # cases generated together: their sequences share verify batches, as under load
MODES = ("off", "pearl", "vanilla")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("context-fill")
    target = make_tiny_checkpoint(root / "target", "llama", seed=41)
    # The target's weights, slightly rescaled: a draft that mostly agrees, so long chains (and trees
    # hanging off them) reach the very end of the context; it still disagrees often enough to reject.
    draft = make_tiny_checkpoint(root / "draft", "llama", seed=41, init_std=0.021)
    return target, draft


def fill_config(pair, name: str = "fill") -> ModelConfig:
    target, draft = pair
    return ModelConfig(
        name=name, target=str(target), draft=str(draft), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN,
        # adaptive off: speculate in every round, whatever the guard would decide on this toy pair
        speculation=SpeculationDefaults(mode=SpeculationMode.PEARL, adaptive=False, cache=True, hedges=4, tree=True,
                                        tree_nodes=8, lookup=True),
    )


def random_cases(seed: int, n: int) -> list[list[int]]:
    """Prompts of random lengths 1 .. MAX_MODEL_LEN - 1 (the request then asks for the rest)."""
    rng = random.Random(seed)
    return [[rng.randrange(4, 384) for _ in range(rng.randint(1, MAX_MODEL_LEN - 1))] for _ in range(n)]


async def _case(coordinator, prompt: list[int], sampled: bool) -> dict:
    room = MAX_MODEL_LEN - len(prompt)
    runs = {mode: run_one(coordinator, request(prompt, room, mode)) for mode in MODES}
    if sampled:  # not comparable token for token, but it must complete all the same
        runs["pearl-sampled"] = run_one(coordinator, request(prompt, room, "pearl",
                                                             SamplingParams(temperature=0.8, seed=len(prompt))))
    results = await asyncio.gather(*runs.values())
    return dict(zip(runs, results))


async def test_every_request_that_fills_the_context_completes_exactly_in_every_mode(pair):
    from duospec.coordinator.local import LocalCoordinator

    coordinator = LocalCoordinator([fill_config(pair)])
    hf = reference_model(str(pair[0]))
    totals = {"tree_nodes": 0, "rejections": 0, "cache_lookups": 0, "branches_taken": 0}
    try:
        prompts = random_cases(seed=38, n=CASES)
        for start in range(0, CASES, AT_ONCE):
            group = prompts[start:start + AT_ONCE]
            results = await asyncio.gather(*(_case(coordinator, p, sampled=(start + i) % 4 == 0)
                                             for i, p in enumerate(group)))
            for prompt, runs in zip(group, results):
                room = MAX_MODEL_LEN - len(prompt)
                for mode, run in runs.items():
                    assert len(run.tokens) == room, (mode, len(prompt))
                    assert run.finish.finish_reason.value == "length", (mode, len(prompt))
                for mode in ("pearl", "vanilla"):
                    assert_greedy_equal(hf, prompt, runs[mode].tokens, runs["off"].tokens)
                stats = runs["pearl"].stats
                totals["tree_nodes"] += stats.tree_nodes
                totals["rejections"] += stats.rejections
                totals["cache_lookups"] += stats.cache_lookups
                # a hedge is taken from the tree when it was ready for the verify, from the cache when
                # it came later: which one depends on timing, so only their sum is bound to be nonzero
                totals["branches_taken"] += stats.tree_hits + stats.cache_hits
    finally:
        await coordinator.close()
    # The cases did exercise what overflowed: trees verified, rejections looked up in the speculation
    # cache, hedged branches taken.
    assert all(totals.values()), totals


@pytest.mark.ray
@pytest.mark.slow
async def test_requests_that_fill_the_context_complete_through_the_server_on_ray_actors(pair, ray_runtime):
    from duospec.coordinator.pipeline import start_pipeline

    coordinator = start_pipeline([fill_config(pair, "fill-ray")])
    hf = reference_model(str(pair[0]))
    settings = ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=0)
    async with running_server(coordinator, settings) as h:  # (its shutdown closes the coordinator)
        for prompt in random_cases(seed=380, n=2):
            outputs = {}
            for mode in (pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_PEARL, pb.SPECULATION_MODE_VANILLA):
                req = pb.GenerateRequest(
                    model="fill-ray", prompt_token_ids=pb.TokenIds(ids=prompt),
                    stopping=pb.StoppingCriteria(max_new_tokens=MAX_MODEL_LEN - len(prompt), ignore_eos=True),
                    speculation=pb.SpeculationParams(mode=mode))
                messages = await collect(h.stub, req, timeout=120)
                assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
                outputs[mode] = [t for m in messages for t in m.token_ids]
            for mode in (pb.SPECULATION_MODE_PEARL, pb.SPECULATION_MODE_VANILLA):
                assert_greedy_equal(hf, prompt, outputs[mode], outputs[pb.SPECULATION_MODE_OFF])
