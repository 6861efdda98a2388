"""Worker actors killed mid-stream: nothing lost, output unchanged (issue: reliability)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from duospec.cluster.actors import actor_name
from duospec.cluster.runtime import NAMESPACE
from exactness import assert_greedy_equal, hf_greedy, reference_model
from pipeline_support import BackgroundLoop, model_config, request, run_all
from tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.ray

MODEL = "failover"


@pytest.fixture(scope="module")
def setup(ray_runtime, tmp_path_factory):
    from duospec.coordinator.pipeline import start_pipeline

    root = tmp_path_factory.mktemp("failover")
    target = make_tiny_checkpoint(root / "target", "llama", seed=21, hidden_size=64, num_layers=2)
    draft = make_tiny_checkpoint(root / "draft", "llama", seed=22, hidden_size=32, num_layers=1)
    loop = BackgroundLoop()
    coordinator = start_pipeline([model_config(MODEL, target, draft)])
    hf = reference_model(target)
    yield coordinator, loop, hf
    loop.run(coordinator.close())
    loop.close()


def _prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 384, size=6).tolist() for _ in range(n)]


def _stats(coordinator, loop):
    return loop.run(coordinator.stats())["models"][MODEL]


def _kill_when_busy(ray, coordinator, loop, role, min_batches):
    """Kills the role's actor (Ray restarts it) once the target has run `min_batches` more batches."""
    start = _stats(coordinator, loop).get("target", {}).get("batches", 0)
    deadline = time.monotonic() + 30
    while _stats(coordinator, loop).get("target", {}).get("batches", 0) < start + min_batches:
        assert time.monotonic() < deadline, "generation did not start"
        time.sleep(0.02)
    ray.kill(ray.get_actor(actor_name(role, MODEL), namespace=NAMESPACE), no_restart=False)


def _wait_connected(coordinator, loop, role, restarts, timeout=90):
    deadline = time.monotonic() + timeout
    while True:
        info = _stats(coordinator, loop)[role]
        if info.get("connected") and info.get("restarts", 0) >= restarts:
            return
        assert time.monotonic() < deadline, f"{role} did not reconnect: {info}"
        time.sleep(0.2)


def test_draft_killed_mid_stream_requests_finish_identically(setup, ray_runtime):
    coordinator, loop, hf = setup
    for round_ in (1, 2):  # several kills in one run
        prompts = _prompts(6, seed=round_)
        n_new = 160
        future = asyncio.run_coroutine_threadsafe(
            run_all(coordinator, [request(p, n_new, "pearl") for p in prompts]), loop.loop
        )
        _kill_when_busy(ray_runtime, coordinator, loop, "draft", min_batches=5)
        results = future.result(180)
        for prompt, result in zip(prompts, results):
            assert len(result.tokens) == n_new
            assert_greedy_equal(hf, prompt, result.tokens, hf_greedy(hf, prompt, n_new))
        _wait_connected(coordinator, loop, "draft", restarts=round_)
        # Ray restarted the drafter: later requests speculate again.
        later = loop.run(run_all(coordinator, [request(prompts[0], 24, "pearl")]))[0]
        assert later.stats.drafted_tokens > 0


def test_target_killed_mid_stream_is_reprefilled_and_resumes(setup, ray_runtime):
    coordinator, loop, hf = setup
    prompts = _prompts(6, seed=7)
    n_new = 160
    future = asyncio.run_coroutine_threadsafe(
        run_all(coordinator, [request(p, n_new, mode) for p, mode in zip(prompts, ["pearl", "vanilla", "off"] * 2)]),
        loop.loop,
    )
    _kill_when_busy(ray_runtime, coordinator, loop, "target", min_batches=5)
    results = future.result(240)
    for prompt, result in zip(prompts, results):
        assert len(result.tokens) == n_new
        assert_greedy_equal(hf, prompt, result.tokens, hf_greedy(hf, prompt, n_new))
    assert _stats(coordinator, loop)["target"]["restarts"] >= 1
