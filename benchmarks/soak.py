"""Soak: a bounded mixed load against a real gRPC server for a set time, then a summary.

    .venv/bin/python benchmarks/soak.py --minutes 5                  # Ray pipeline, actor kills on
    .venv/bin/python benchmarks/soak.py --minutes 1 --backend local  # in-process, no kills

Several tenants (different weights and limits) run a fixed number of client loops; each request is
one of: a normal generation, a client cancel after a few messages, a short deadline, an invalid
request, a bad API key. Against the Ray pipeline the draft and target actors are killed in turn
(`ray.kill(..., no_restart=False)`, so Ray restarts them). Every `--report-every` seconds it prints
requests so far, tokens served and resident memory (this process and each worker actor); at the end
requests by status code, tokens served, the memory timeline, and leak checks (live sequences on the
workers, admission counters). Exits 1 if any call ended INTERNAL/UNKNOWN or something leaked.

Models: --model-dir DIR (DIR/target + DIR/draft), else the bundled pair in models/ when present,
else two tiny random-weight llama checkpoints built in a temporary folder.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import pathlib
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field

REPO = pathlib.Path(__file__).resolve().parents[1]
MODEL = "soak"
BAD_CODES = ("INTERNAL", "UNKNOWN")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=5.0, help="how long to apply load (default 5)")
    p.add_argument("--backend", choices=("ray", "local"), default="ray")
    p.add_argument("--model-dir", type=pathlib.Path, help="DIR/target (+ DIR/draft); default models/ or tiny")
    p.add_argument("--clients", type=int, default=10, help="concurrent client loops (default 10)")
    p.add_argument("--kill-every", type=float, default=45.0,
                   help="seconds between actor kills, ray backend only; 0 = no kills (default 45)")
    p.add_argument("--report-every", type=float, default=20.0, help="seconds between progress lines")
    p.add_argument("--max-concurrent", type=int, default=6, help="server.max_concurrent_requests")
    p.add_argument("--max-queued", type=int, default=6, help="server.max_queued_requests")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.clients < 1 or args.report_every <= 0:
        p.error("--minutes and --report-every must be > 0 and --clients >= 1")
    return args


# ---- setup ----------------------------------------------------------------------------------------

def model_pair(model_dir: pathlib.Path | None, scratch: pathlib.Path) -> tuple[str, str]:
    root = model_dir or REPO / "models"
    if (root / "target" / "config.json").is_file() and (root / "draft" / "config.json").is_file():
        return str(root / "target"), str(root / "draft")
    if model_dir is not None:
        sys.exit(f"--model-dir: {model_dir} needs target/config.json and draft/config.json")
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import make_tiny_checkpoint

    target = make_tiny_checkpoint(scratch / "target", "llama", seed=1, max_position_embeddings=256)
    draft = make_tiny_checkpoint(scratch / "draft", "llama", seed=2, hidden_size=32, num_layers=1,
                                 max_position_embeddings=256)
    print(f"models: tiny random-weight llama pair in {scratch} (no bundled pair in models/)")
    return str(target), str(draft)


def make_tenants():
    from duospec.coordinator.tenants.tenancy import Tenant, TenantLimits, hash_api_key, new_api_key

    keys = {name: new_api_key() for name in ("gold", "silver", "bronze")}
    tenants = [
        Tenant("gold", key_hashes=(hash_api_key(keys["gold"]),), priority_weight=3.0),
        Tenant("silver", key_hashes=(hash_api_key(keys["silver"]),)),
        Tenant("bronze", key_hashes=(hash_api_key(keys["bronze"]),),
               limits=TenantLimits(tokens_per_minute=4000, max_concurrent_streams=2)),
    ]
    return tenants, keys


def start_coordinator(backend: str, target: str, draft: str):
    from duospec.coordinator.config import ModelConfig

    config = ModelConfig(name=MODEL, target=target, draft=draft, device="cpu")
    if backend == "local":
        from duospec.coordinator.local import LocalCoordinator

        return LocalCoordinator([config])
    from duospec.coordinator.pipeline import start_pipeline

    return start_pipeline([config])


def rss_mb(pid: int | str = "self") -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


# ---- load -----------------------------------------------------------------------------------------

@dataclass
class Tally:
    by_status: collections.Counter = field(default_factory=collections.Counter)  # "OK/length", "UNAVAILABLE", ...
    by_kind: collections.Counter = field(default_factory=collections.Counter)
    tokens: int = 0
    bad: list[str] = field(default_factory=list)  # INTERNAL/UNKNOWN details, first few

    @property
    def requests(self) -> int:
        return sum(self.by_status.values())


KINDS = (("normal", 0.6), ("cancel", 0.15), ("deadline", 0.15), ("invalid", 0.05), ("bad_key", 0.05))


def build_request(kind: str, rng: random.Random):
    from duospec.v1 import generation_pb2 as pb

    modes = (pb.SPECULATION_MODE_PEARL, pb.SPECULATION_MODE_PEARL, pb.SPECULATION_MODE_VANILLA,
             pb.SPECULATION_MODE_OFF)
    temperature = rng.choice((0.0, 0.0, 0.8, 1.2))
    req = pb.GenerateRequest(
        prompt=rng.choice(("def f(x):", "import os\n", "class A:\n    def", "for i in range(")),
        sampling=pb.SamplingParams(temperature=temperature, top_k=rng.choice((0, 20)), seed=rng.randrange(1 << 32)),
        stopping=pb.StoppingCriteria(max_new_tokens=rng.randint(8, 96), ignore_eos=rng.random() < 0.5),
        speculation=pb.SpeculationParams(mode=rng.choice(modes)),
    )
    if kind == "invalid":
        req.sampling.temperature = -1.0
    return req


async def one_request(stub, key: str, kind: str, rng: random.Random, tally: Tally) -> None:
    import grpc

    from duospec.v1 import generation_pb2 as pb

    req = build_request(kind, rng)
    metadata = (("authorization", f"Bearer {key if kind != 'bad_key' else 'nope-' + key[:8]}"),)
    timeout = rng.uniform(0.2, 1.5) if kind == "deadline" else 120.0
    cancel_after = rng.randint(1, 4) if kind == "cancel" else None
    call = stub.Generate(req, metadata=metadata, timeout=timeout)
    status, n_messages = None, 0
    try:
        async for m in call:
            tally.tokens += len(m.token_ids)
            n_messages += 1
            if m.finish_reason:
                status = "OK/" + pb.FinishReason.Name(m.finish_reason).removeprefix("FINISH_REASON_").lower()
            if cancel_after is not None and n_messages >= cancel_after:
                call.cancel()
                status = "CANCELLED(client)"
                break
    except grpc.aio.AioRpcError as err:
        status = err.code().name
        if status in BAD_CODES and len(tally.bad) < 10:
            tally.bad.append(f"{kind}: {status}: {err.details()}")
    tally.by_status[status or "OK/no-finish"] += 1
    tally.by_kind[kind] += 1


async def client_loop(stub, keys: dict, tenant: str, rng: random.Random, until: float, tally: Tally) -> None:
    names, weights = zip(*KINDS)
    while time.monotonic() < until:
        kind = rng.choices(names, weights)[0]
        await one_request(stub, keys[tenant], kind, rng, tally)
        if tally.by_status.get("RESOURCE_EXHAUSTED"):
            await asyncio.sleep(rng.uniform(0.0, 0.2))  # a polite client backs off a little


# ---- chaos and monitoring ---------------------------------------------------------------------------

async def kill_loop(every_s: float, until: float, kills: list[tuple[float, str]], t0: float) -> None:
    import ray

    from duospec.cluster.actors import actor_name
    from duospec.cluster.runtime import NAMESPACE

    roles = ("draft", "target")
    i = 0
    while time.monotonic() + every_s < until:
        await asyncio.sleep(every_s)
        role = roles[i % 2]
        i += 1
        try:
            ray.kill(ray.get_actor(actor_name(role, MODEL), namespace=NAMESPACE), no_restart=False)
            kills.append((time.monotonic() - t0, role))
            print(f"[{time.monotonic() - t0:6.1f}s] killed the {role} actor (Ray restarts it)", flush=True)
        except Exception as exc:  # e.g. still restarting from the previous kill
            print(f"[{time.monotonic() - t0:6.1f}s] could not kill {role}: {type(exc).__name__}: {exc}", flush=True)


async def worker_snapshot(coordinator) -> dict[str, dict]:
    try:
        return (await asyncio.wait_for(coordinator.worker_stats(), 15)).get(MODEL, {})
    except Exception as exc:
        return {"error": {"error": type(exc).__name__}}


async def monitor_loop(coordinator, server, tally: Tally, every_s: float, until: float, t0: float,
                       timeline: list) -> None:
    while time.monotonic() < until:
        await asyncio.sleep(min(every_s, max(0.0, until - time.monotonic())))
        workers = await worker_snapshot(coordinator)
        row = {"t": time.monotonic() - t0, "server_rss": rss_mb(), "requests": tally.requests, "tokens": tally.tokens}
        for role, s in workers.items():
            row[f"{role}_rss"] = rss_mb(s["pid"]) if "pid" in s else float("nan")  # nan: in-process (local backend)
            row[f"{role}_live"] = s.get("live_sequences", "?")
        timeline.append(row)
        actor_mem = "  ".join(f"{r} {row.get(f'{r}_rss', float('nan')):.0f} MB (live {row.get(f'{r}_live')})"
                              for r in ("target", "draft") if f"{r}_rss" in row)
        print(f"[{row['t']:6.1f}s] requests {tally.requests:5d}  tokens {tally.tokens:7d}  running "
              f"{server.admission.running} queued {server.admission.waiting}  RSS server {row['server_rss']:.0f} MB"
              f"  {actor_mem}", flush=True)


async def wait_idle(coordinator, server, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        workers = await worker_snapshot(coordinator)
        idle = all(s.get("live_sequences") == 0 for s in workers.values()) and server.admission.running == 0
        if idle or time.monotonic() > deadline:
            return workers
        await asyncio.sleep(0.2)


# ---- main -----------------------------------------------------------------------------------------

async def soak(args: argparse.Namespace, target: str, draft: str, scratch: pathlib.Path) -> int:
    import grpc

    from duospec.coordinator.config import ServerSettings
    from duospec.coordinator.serving.server import DuospecServer
    from duospec.v1 import generation_pb2_grpc as pb_grpc

    tenants, keys = make_tenants()
    coordinator = start_coordinator(args.backend, target, draft)
    settings = ServerSettings(port=0, metrics_port=0, http_port=0, max_concurrent_requests=args.max_concurrent,
                              max_queued_requests=args.max_queued, grace_period_s=10.0)
    server = DuospecServer(coordinator, settings, tenants=tenants, ledger_path=str(scratch / "usage.db"))
    port = await server.start()
    await server.wait_ready(120)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.GenerationServiceStub(channel)
    tally, kills, timeline = Tally(), [], []
    rss_start = rss_mb()
    t0 = time.monotonic()
    until = t0 + args.minutes * 60
    rng = random.Random(args.seed)
    names = [t.name for t in tenants]
    tasks = [client_loop(stub, keys, names[i % len(names)], random.Random(rng.random()), until, tally)
             for i in range(args.clients)]
    tasks.append(monitor_loop(coordinator, server, tally, args.report_every, until, t0, timeline))
    if args.backend == "ray" and args.kill_every > 0:
        tasks.append(kill_loop(args.kill_every, until, kills, t0))
    kills_note = f", actor kill every {args.kill_every:g} s" if len(tasks) > args.clients + 1 else ", no actor kills"
    print(f"soak: {args.minutes:g} min, backend {args.backend}, {args.clients} clients, tenants {names}"
          f"{kills_note}", flush=True)
    try:
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - t0
        workers = await wait_idle(coordinator, server)
        leaks = _leaks(workers, server)
    finally:
        await channel.close()
        await server.shutdown(grace_period_s=5.0)  # also closes the coordinator (and the Ray actors)
    print_summary(args, tally, kills, timeline, elapsed, rss_start, workers, leaks)
    return 1 if tally.bad or leaks or any(c in tally.by_status for c in BAD_CODES) else 0


def _leaks(workers: dict, server) -> list[str]:
    out = [f"{role}: {s.get('live_sequences')} live sequences after the load stopped"
           for role, s in workers.items() if s.get("live_sequences") != 0]
    if server.admission.running or server.admission.waiting:
        out.append(f"admission: {server.admission.running} running, {server.admission.waiting} queued")
    if server.lifecycle.active_streams:
        out.append(f"server: {server.lifecycle.active_streams} streams still open")
    return out


def print_summary(args, tally: Tally, kills, timeline, elapsed, rss_start, workers, leaks) -> None:
    print("\n==== soak summary ====")
    print(f"backend {args.backend}, {elapsed:.0f} s of load, {args.clients} clients, "
          f"max_concurrent {args.max_concurrent}, max_queued {args.max_queued}")
    print(f"requests: {tally.requests} ({tally.requests / elapsed:.1f}/s); by kind {dict(tally.by_kind)}")
    print("requests by status:")
    for status, n in sorted(tally.by_status.items(), key=lambda kv: -kv[1]):
        print(f"  {status:<22} {n:6d}")
    print(f"tokens served: {tally.tokens} ({tally.tokens / elapsed:.1f}/s)")
    print(f"actor kills: {len(kills)} " + ", ".join(f"{role}@{t:.0f}s" for t, role in kills))
    print("resident memory (MB) over time:")
    print(f"  {'t(s)':>6} {'server':>8} {'target':>8} {'draft':>8}")
    print(f"  {0.0:6.0f} {rss_start:8.0f}")
    for row in timeline:
        print(f"  {row['t']:6.0f} {row['server_rss']:8.0f} {row.get('target_rss', float('nan')):8.0f} "
              f"{row.get('draft_rss', float('nan')):8.0f}")
    print(f"workers after the load: " + ", ".join(
        f"{role} live {s.get('live_sequences')} free {s.get('free_slots')}" for role, s in workers.items()))
    for line in tally.bad:
        print(f"BAD: {line}")
    print("leaks: " + ("; ".join(leaks) if leaks else "none"))


def main(argv=None) -> int:
    import logging

    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="duospec-soak-") as tmp:
        scratch = pathlib.Path(tmp)
        target, draft = model_pair(args.model_dir, scratch)
        return asyncio.run(soak(args, target, draft, scratch))


if __name__ == "__main__":
    sys.exit(main())
