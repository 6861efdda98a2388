"""Tensor-parallel worker groups through the real gRPC server on Ray actors (gloo on CPU): the bundled
pair with the target at TP=2 (and once with the draft at TP=2 too) gives the greedy output of
transformers in every mode, seeded sampled output repeats, sampled output follows the target's
distribution (chi-square), and a rank killed with SIGKILL mid-stream
takes its group down, Ray restarts it, and the requests finish with the exact output."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from duospec.bench.prompts import load_prompts
from duospec.coordinator.config import ServerSettings
from duospec.v1 import generation_pb2 as pb
from exactness import assert_greedy_equal, chi_square_pvalue, hf_greedy, reference_model
from pipeline_support import model_config
from server_support import collect, running_server

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODELS = Path(__file__).resolve().parents[2] / "models"
TARGET, DRAFT = MODELS / "target", MODELS / "draft"
SETTINGS = ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=0)
N_PROMPTS, N_NEW = 20, 24
MODES = (pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_PEARL, pb.SPECULATION_MODE_VANILLA)


@pytest.fixture(scope="module")
def reference():
    tokenizer = AutoTokenizer.from_pretrained(str(TARGET))
    hf = reference_model(str(TARGET))
    prompts = [tokenizer(p.text, add_special_tokens=False)["input_ids"] for p in load_prompts(limit=N_PROMPTS)]
    return hf, prompts, [hf_greedy(hf, p, N_NEW) for p in prompts]


def _config(name: str, draft_tp: int):
    config = model_config(name, TARGET, DRAFT, max_draft_tokens=4)
    return dataclasses.replace(config, tensor_parallel_size=2, max_model_len=256,
                               draft=dataclasses.replace(config.draft, tensor_parallel_size=draft_tp))


def _request(prompt, n, mode, sampling=None) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=prompt), sampling=sampling,
                              stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True),
                              speculation=pb.SpeculationParams(mode=mode))


async def _tokens(h, req, timeout=240) -> list[int]:
    return [t for m in await collect(h.stub, req, timeout=timeout) for t in m.token_ids]


async def test_sampled_output_at_tp_2_follows_the_targets_distribution(ray_runtime, reference):
    """Chi-square of the first two sampled tokens (top-k 4: 16 outcomes) against transformers' exact
    joint distribution, with the target's logits gathered from two vocabulary shards."""
    from duospec.coordinator.pipeline import start_pipeline
    from test_decoding import _exact_two_token_distribution
    from duospec.sampling import SamplingParams

    hf, prompts, _ = reference
    prompt = prompts[1]
    joint = _exact_two_token_distribution(hf, prompt, SamplingParams(temperature=1.0, top_k=4))
    n, at_once = 1200, 16
    coordinator = start_pipeline([_config("tp-chi", 1)])
    async with running_server(coordinator, SETTINGS) as h:
        gate = asyncio.Semaphore(at_once)

        async def one(seed: int):
            sampling = pb.SamplingParams(temperature=1.0, top_k=4, seed=seed)
            async with gate:
                return await collect(h.stub, _request(prompt, 2, pb.SPECULATION_MODE_PEARL, sampling), timeout=240)

        runs = await asyncio.gather(*(one(5000 + i) for i in range(n)))
    drafted = sum(m.stats.drafted_tokens for messages in runs for m in messages)
    assert drafted > n // 2  # the draft's tokens were really verified, not only the target sampling
    counts = collections.Counter(tuple(t for m in messages for t in m.token_ids) for messages in runs)
    assert set(counts) <= set(joint)
    p_value = chi_square_pvalue(joint, counts, n)
    assert p_value > 1e-3, f"sampled output at TP=2 does not follow p (chi-square p={p_value:.2e})"


@pytest.mark.parametrize("draft_tp", [1, 2])
async def test_tensor_parallel_groups_serve_the_targets_greedy_output_in_every_mode(ray_runtime, reference, draft_tp):
    from duospec.coordinator.pipeline import start_pipeline

    hf, prompts, want = reference
    coordinator = start_pipeline([_config(f"tp-d{draft_tp}", draft_tp)])
    pair = coordinator.pairs[f"tp-d{draft_tp}"]
    assert pair.target_info["tensor_parallel_size"] == 2 and pair.draft_info["tensor_parallel_size"] == draft_tp
    async with running_server(coordinator, SETTINGS) as h:  # (its shutdown closes the coordinator)
        runs = [(i, mode) for i in range(len(prompts)) for mode in MODES]
        got = await asyncio.gather(*(_tokens(h, _request(prompts[i], N_NEW, mode)) for i, mode in runs))
        for (i, mode), tokens in zip(runs, got):
            assert_greedy_equal(hf, prompts[i], tokens, want[i])
        sampled = pb.SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
        first, second = [await _tokens(h, _request(prompts[0], N_NEW, pb.SPECULATION_MODE_PEARL, sampled))
                         for _ in range(2)]
        assert first == second and len(first) == N_NEW
        stats = (await coordinator.stats())["models"][f"tp-d{draft_tp}"]
        assert stats["draft"]["connected"] and stats["target"]["restarts"] == 0


async def test_a_rank_killed_mid_stream_restarts_its_group_and_the_requests_finish_exactly(ray_runtime, reference):
    from duospec.coordinator.pipeline import start_pipeline

    hf, prompts, _ = reference
    name = "tp-kill"
    coordinator = start_pipeline([_config(name, 1)])
    pair = coordinator.pairs[name]
    follower = pair.target_info["ranks"][0]["pid"]
    n_new = 96
    async with running_server(coordinator, SETTINGS) as h:
        live = [asyncio.ensure_future(_tokens(h, _request(prompts[i], n_new, mode)))
                for i, mode in zip(range(3), MODES)]
        deadline = time.monotonic() + 120
        while (await coordinator.stats())["models"][name].get("target", {}).get("batches", 0) < 5:
            assert time.monotonic() < deadline, "generation did not start"
            await asyncio.sleep(0.02)
        os.kill(follower, signal.SIGKILL)  # rank 1 of the target's group
        results = await asyncio.gather(*live)
        for i, tokens in enumerate(results):
            assert len(tokens) == n_new
            assert_greedy_equal(hf, prompts[i], tokens, hf_greedy(hf, prompts[i], n_new))
        stats = (await coordinator.stats())["models"][name]
        assert stats["target"]["restarts"] >= 1
        # the whole group came back: a new rank 0 with a new rank 1, which serve again
        assert pair.target_info["ranks"][0]["pid"] != follower
        again = await _tokens(h, _request(prompts[3], 16, pb.SPECULATION_MODE_PEARL))
        assert_greedy_equal(hf, prompts[3], again, hf_greedy(hf, prompts[3], 16))


@pytest.mark.parametrize("method", ["eagle", "medusa"])
async def test_head_drafters_read_a_tensor_parallel_targets_hidden_states(ray_runtime, reference, method):
    """The bundled heads draft from the hidden states the target sends; at TP=2 rank 0 sends the
    all-reduced rows, which must be the one-device target's: greedy output stays exact, and the drafts
    the head makes from them are accepted as often as at TP=1 (a wrong or partial hidden state would
    leave the output exact but the acceptance near zero)."""
    from duospec.coordinator.pipeline import start_pipeline
    from duospec.draft_worker.proposer import DraftMethod, DraftSpec

    hf, prompts, want = reference
    accepted = {}
    for tp in (1, 2):
        name = f"tp{tp}-{method}"
        config = dataclasses.replace(model_config(name, TARGET, None, max_draft_tokens=4), tensor_parallel_size=tp,
                                     max_model_len=256, draft=DraftSpec(method=DraftMethod(method),
                                                                        path=str(MODELS / method)))
        coordinator = start_pipeline([config])
        assert coordinator.pairs[name].target_info["tensor_parallel_size"] == tp
        async with running_server(coordinator, SETTINGS) as h:
            runs = [(i, mode) for i in range(6) for mode in (pb.SPECULATION_MODE_VANILLA, pb.SPECULATION_MODE_PEARL)]
            got = await asyncio.gather(*(collect(h.stub, _request(prompts[i], N_NEW, mode), timeout=240)
                                         for i, mode in runs))
            for (i, mode), messages in zip(runs, got):
                assert_greedy_equal(hf, prompts[i], [t for m in messages for t in m.token_ids], want[i])
            accepted[tp] = sum(m.stats.accepted_tokens for (i, mode), messages in zip(runs, got)
                               if mode == pb.SPECULATION_MODE_VANILLA for m in messages)
            # again, now that its blocks and their hidden rows are cached (rank 0 keeps the rows)
            again = await collect(h.stub, _request(prompts[0], N_NEW, pb.SPECULATION_MODE_VANILLA), timeout=240)
            assert [t for m in again for t in m.token_ids] == want[0]
            assert again[-1].usage.cached_prompt_tokens >= 16 * ((len(prompts[0]) - 1) // 16) > 0
    print(f"{method}: accepted at TP=1 {accepted[1]}, at TP=2 {accepted[2]}")
    assert accepted[1] >= 10  # the bundled head does predict the bundled target
    assert accepted[2] >= 0.9 * accepted[1], accepted
