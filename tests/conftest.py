"""Shared test fixtures.

One Ray instance serves the whole session (ray.init costs ~6 s). Model actors each take one torch
thread; the instance declares 2 logical GPUs so placement code runs the same as on a GPU node.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_session():
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
