"""Shared test fixtures, for every layer (unit/, engine/, scheduler/, actors/, e2e/).

One Ray instance serves the whole test run (ray.init costs ~6 s). Model actors each take one torch
thread; the instance declares 2 logical GPUs so placement code runs the same as on a GPU node.

DUOSPEC_TEST_DEVICE=cuda runs the device-aware tests (engine parity, bf16 exactness, the batched
verify rule: the `test_device` fixture) on a GPU; benchmarks/gpu_check.sh sets it.
"""

from __future__ import annotations

import os

import pytest

from server_support import tiny_pair  # noqa: F401  (the bundled-shape tiny pair, a fixture for every test)
from postgres_support import pg_url, postgres  # noqa: F401  (a real PostgreSQL server, for the shared ledger)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def test_device() -> str:
    device = os.environ.get("DUOSPEC_TEST_DEVICE", "cpu")
    if device not in ("cpu", "cuda"):
        pytest.fail(f"DUOSPEC_TEST_DEVICE={device!r}: use cpu or cuda")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.fail("DUOSPEC_TEST_DEVICE=cuda but torch sees no CUDA device")
    return device


@pytest.fixture(scope="session")
def ray_runtime():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(
            num_cpus=4,
            num_gpus=2,
            include_dashboard=False,
            namespace="duospec-tests",
            log_to_driver=False,
            configure_logging=False,
        )
    yield ray
    ray.shutdown()
