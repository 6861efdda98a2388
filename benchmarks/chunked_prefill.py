"""Chunked prefill, measured: a stream decodes while a 1,900-token prompt arrives (bundled pair, mode
off, in-process). Prints, per prefill_chunk_tokens (one-shot, 512, 128; medians of 3 runs), the
decoding stream's longest and median inter-token gap and the long prompt's time to its 2 tokens.

    python benchmarks/chunked_prefill.py
"""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import statistics
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # pipeline_support.model_config

from duospec.coordinator.api import GenerationRequest, SpeculationMode, TokensEvent  # noqa: E402
from duospec.coordinator.local import LocalCoordinator  # noqa: E402
from pipeline_support import model_config  # noqa: E402

ONE_SHOT = 1 << 20


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(10, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def _gaps(coordinator, prompt: list[int], n: int, request_id: str) -> list[float]:
    gaps, last = [], None
    request = GenerationRequest(request_id, tuple(prompt), n, mode=SpeculationMode.OFF, model="m", ignore_eos=True)
    async for event in coordinator.generate(request):
        if isinstance(event, TokensEvent):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps


async def _measure(chunk: int) -> tuple[float, float, float]:
    config = dataclasses.replace(model_config("m", REPO / "models" / "target", REPO / "models" / "draft"),
                                 prefill_chunk_tokens=chunk)
    coordinator = LocalCoordinator([config])
    try:
        await _gaps(coordinator, _prompt(8, 0), 4, "warm-up")
        decoding = asyncio.ensure_future(_gaps(coordinator, _prompt(8, 1), 300, "a"))
        await asyncio.sleep(0.1)
        start = time.perf_counter()
        await _gaps(coordinator, _prompt(1900, 2), 2, "long")
        long_prompt_s = time.perf_counter() - start
        gaps = await decoding
        return max(gaps), statistics.median(gaps), long_prompt_s
    finally:
        await coordinator.close()


async def main() -> None:
    torch.set_num_threads(1)
    print("| prefill_chunk_tokens | decoding stream: longest gap (ms) | median gap (ms) | long prompt: 2 tokens (ms) |")
    print("|---|---:|---:|---:|")
    for chunk in (ONE_SHOT, 512, 128):
        runs = [await _measure(chunk) for _ in range(3)]
        longest, median, long_prompt = (statistics.median(r[i] for r in runs) for i in range(3))
        label = "one-shot" if chunk == ONE_SHOT else str(chunk)
        print(f"| {label} | {1000 * longest:.0f} | {1000 * median:.2f} | {1000 * long_prompt:.0f} |")


if __name__ == "__main__":
    asyncio.run(main())
