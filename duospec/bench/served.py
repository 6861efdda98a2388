"""Runs through the full server: the Ray pipeline (draft and target actors, gRPC data plane) behind an
in-process DuospecServer on a loopback port, driven through the SDK's AsyncClient.

Also measures what the coordinator and the internal gRPC streams add to each verify round, and the
concurrency sweep (several client streams at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

from duospec.bench import arithmetic as ar
from duospec.bench.guards import use_speculation_choices
from duospec.bench.inprocess import MODEL_NAME, BenchPair, EncodedPrompt, model_config, run_coordinator_mode
from duospec.bench.records import RequestRecord, Run, request_mode, window

SERVER_READY_TIMEOUT_S = 300.0


@dataclass
class Served:
    coordinator: object  # coordinator.pipeline.PipelineCoordinator
    client: object  # duospec.sdk.aio.AsyncClient
    model: str = MODEL_NAME  # the model name requests ask for


@contextlib.asynccontextmanager
async def served_pipeline(pair: BenchPair, speculation, ray_address: str | None, replicas: int = 1):
    async with served_pipelines({MODEL_NAME: pair}, speculation, ray_address, replicas) as served:
        yield served[MODEL_NAME]


@contextlib.asynccontextmanager
async def served_pipelines(pairs: dict[str, BenchPair], speculation, ray_address: str | None, replicas: int = 1):
    """One pipeline and server serving a model per pair ({model name: pair}), so a benchmark can
    alternate between them request by request and the machine's drift hits all of them alike; each
    with the `speculation` defaults (coordinator.config.SpeculationDefaults) and `replicas` pairs of
    actors (models[].replicas)."""
    from duospec.cluster.runtime import connect
    from duospec.coordinator.config import ServerSettings
    from duospec.coordinator.pipeline import start_pipeline
    from duospec.coordinator.serving.server import DuospecServer
    from duospec.sdk.aio import AsyncClient

    configs = [dataclasses.replace(model_config(pair, speculation, name), replicas=replicas)
               for name, pair in pairs.items()]
    if ray_address is None and len(pairs) > 1:
        # Each pair asks for two 1-CPU actors. A local instance declares enough logical CPUs for all of
        # them: only one pair works at a time, the others' actors wait idle.
        connect(None, num_cpus=2 * len(pairs))
    coordinator = start_pipeline(configs, ray_address=ray_address)
    server = DuospecServer(coordinator, ServerSettings(host="127.0.0.1", port=0, metrics_port=0, http_port=0),
                           default_modes={c.name: c.speculation.mode for c in configs})
    try:
        port = await server.start()
        await server.wait_ready(SERVER_READY_TIMEOUT_S)
        async with AsyncClient(f"127.0.0.1:{port}", timeout=600) as client:
            yield {name: Served(coordinator, client, name) for name in pairs}
    finally:
        await server.shutdown(grace_period_s=1.0)


async def client_request(client, prompt: EncodedPrompt, mode: str, max_new_tokens: int, model: str = "") -> RequestRecord:
    """One streamed Generate call (timings: RequestRecord.streamed)."""
    tokens: list[int] = []
    arrivals: list[tuple[float, int]] = []
    final = None
    started = time.perf_counter()
    mode, cache, tree = request_mode(mode)
    stream = await client.generate(prompt_token_ids=list(prompt.token_ids), model=model, max_new_tokens=max_new_tokens,
                                   mode=mode, ignore_eos=True, stream=True,
                                   speculation_cache=cache, speculation_tree=tree)
    async with stream:
        async for chunk in stream:
            if chunk.token_ids:
                arrivals.append((time.perf_counter(), len(chunk.token_ids)))
                tokens.extend(chunk.token_ids)
            if chunk.stats is not None:
                final = chunk.stats
    record = RequestRecord.streamed(prompt.id, tokens, started, time.perf_counter(), arrivals)
    if final is not None:
        record.take_counts(final)
    return record


async def run_client_mode(served: Served, prompts: list[EncodedPrompt], mode: str, max_new_tokens: int,
                          tick: Callable[[], None], variant: str | None = None) -> Run:
    """`variant`: as in inprocess.run_coordinator_mode."""
    use_speculation_choices(served.coordinator, variant or mode)  # each pearl variant learns on its own, once
    before = await served.coordinator.stats()
    started = time.perf_counter()
    records = []
    for prompt in prompts:
        records.append(await client_request(served.client, prompt, mode, max_new_tokens, served.model))
        tick()
    wall = time.perf_counter() - started
    return Run(mode, "server", wall, records, window(before, await served.coordinator.stats(), served.model))


async def sweep_point(served: Served, prompts: list[EncodedPrompt], mode: str, streams: int, requests_per_stream: int,
                      max_new_tokens: int, tick: Callable[[], None]) -> dict:
    """`streams` client streams at once, each running `requests_per_stream` requests back to back."""
    use_speculation_choices(served.coordinator, mode)

    stream_ends: list[float] = []

    async def stream_worker(index: int) -> list[RequestRecord]:
        out = []
        for j in range(requests_per_stream):
            prompt = prompts[(index * requests_per_stream + j) % len(prompts)]
            out.append(await client_request(served.client, prompt, mode, max_new_tokens, served.model))
            tick()
        stream_ends.append(time.perf_counter())
        return out

    started = time.perf_counter()
    per_stream = await asyncio.gather(*(stream_worker(i) for i in range(streams)))
    wall = time.perf_counter() - started
    records = [r for rs in per_stream for r in rs]
    arrivals = [a for r in records for a in r.arrivals]
    ttft = [r.first_token_s for r in records if r.first_token_s is not None]
    itl = [gap for r in records for gap in r.inter_token_s]
    return {
        "mode": mode,
        "streams": streams,
        "requests": len(records),
        "tokens": sum(len(r.token_ids) for r in records),
        "wall_s": wall,
        "aggregate_tokens_per_s": ar.tokens_per_second(sum(len(r.token_ids) for r in records), wall),
        "all_live_tokens_per_s": ar.all_live_tokens_per_s(arrivals, started, stream_ends),
        "tail_share": ar.tail_share(started, stream_ends),
        "ttft_p50_s": ar.percentile(ttft, 50),
        "ttft_p99_s": ar.percentile(ttft, 99),
        "itl_p50_s": ar.percentile(itl, 50) if itl else None,
        "itl_p99_s": ar.percentile(itl, 99) if itl else None,
    }


async def round_overhead(coordinator, prompts: list[EncodedPrompt], max_new_tokens: int, path: str,
                         tick: Callable[[], None]) -> dict:
    """Target-only requests one at a time: every round's sequence is ready the moment its verdict is
    in, so wall time not spent in the target's own verify work is overhead: the coordinator's handling
    of each verdict (applying it, sending the next batch), and the rest — the links' serialisation,
    transport and thread or process wake-ups, and the coordinator's other work in between (streaming
    tokens to the clients)."""
    run = await run_coordinator_mode(coordinator, prompts, "off", max_new_tokens, path, f"overhead-{path}", tick)
    w = run.workers
    return {
        "path": path,
        "wall_s": run.wall_s,
        "target_busy_s": w.target_busy_s,
        "rounds": w.target_rounds,
        "wall_per_round_s": run.wall_s / w.target_rounds,
        "target_per_round_s": w.target_busy_s / w.target_rounds,
        "overhead_per_round_s": ar.overhead_per_round_s(run.wall_s, w.target_busy_s, w.target_rounds),
        "handling_per_round_s": w.verdict_handling_s / w.target_rounds,
    }
