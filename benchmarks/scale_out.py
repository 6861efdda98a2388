"""The scaled-out front's ceiling (issue 45): aggregate tokens/s through `duospec serve --gateways G` for
1 and 4 replicas of one model, 8 client streams per replica, on SIMULATED devices, with the CPU each
process used.

    python benchmarks/scale_out.py                         # gateways 2, replicas 1 4, pearl, 64 new tokens
    python benchmarks/scale_out.py --gateways 1 2 --replicas 1 4

Each point starts a real `duospec serve` (its own local Ray, `--num-cpus` enough for every replica's
two actors) whose workers are the replay runners of `duospec bench --simulate devices`: every forward
sleeps for the cost measured on this machine instead of computing, so what limits the aggregate is
what is real — the gateways (gRPC + HTTP fronts, admission, routing, the hop to the schedulers), the
replicas' scheduler actors (the PEARL loop, the streams to the workers) and the workers' gRPC
handling. With `--gateways 1` the one process holds every scheduler (today's default), for the side by
side. The client streams run in this process, spread over 8 channels so SO_REUSEPORT spreads them over
the gateways.

Prints per point: aggregate tokens/s and its ratio to one replica with the same gateways, and the CPU
of each kind of process as a share of one core over the measured window (the busiest one of each
kind, and all of them), plus the schedulers' CPU per verify round and the gateways' per request and
per token: the figures a capacity model on GPU verify times needs (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
STREAMS_PER_REPLICA = 8
CHANNELS = 8  # client connections: the kernel spreads connections, not streams, over the gateways
_TICKS = os.sysconf("SC_CLK_TCK")
KINDS = {"gateway": ("duospec-gateway",), "scheduler": ("SchedulerActor",), "workers": ("TargetWorker", "DraftWorker")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes() -> dict[int, str]:
    """pid -> command line (with the process title a gateway or a Ray actor sets) of this user's processes."""
    out = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
    return out


def _cpu_seconds(pid: int) -> float:
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime


def _kind_of(cmdline: str) -> str | None:
    return next((kind for kind, marks in KINDS.items() if any(m in cmdline for m in marks)), None)


def _write_config(folder: pathlib.Path, pair, speculation, replicas: int, gateways: int, port: int) -> pathlib.Path:
    import yaml

    spec = {k: (v.value if hasattr(v, "value") else v) for k, v in vars(speculation).items()}
    config = {"server": {"host": "127.0.0.1", "port": port, "http_port": 0, "metrics_port": 0,
                         "gateways": gateways, "ray_num_cpus": 2 * replicas + 2,
                         "max_concurrent_requests": 1024, "max_queued_requests": 1024},
              "ledger": str(folder / f"usage-{replicas}-{gateways}.db"),
              "models": [{"name": "bench", "target": pair.target, "draft": pair.draft, "device": "cpu",
                          "replicas": replicas, "max_num_seqs": 16, "speculation": spec}]}
    path = folder / f"serve-{replicas}-{gateways}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def _wait_serving(port: int, timeout_s: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError(f"duospec serve did not turn SERVING on {port} within {timeout_s:.0f} s")


async def _run_streams(port: int, prompts, mode: str, streams: int, requests: int, max_new_tokens: int) -> tuple:
    from duospec.bench.served import client_request
    from duospec.sdk.aio import AsyncClient

    clients = [AsyncClient(f"127.0.0.1:{port}", timeout=600,
                           grpc_options=(("grpc.use_local_subchannel_pool", 1),)) for _ in range(CHANNELS)]
    started = time.perf_counter()
    tokens = 0

    async def stream(i: int) -> None:
        nonlocal tokens
        for r in range(requests):
            record = await client_request(clients[i % CHANNELS], prompts[(i + r) % len(prompts)], mode, max_new_tokens)
            tokens += len(record.token_ids)

    await asyncio.gather(*(stream(i) for i in range(streams)))
    wall = time.perf_counter() - started
    for client in clients:
        await client.close()
    return tokens, wall


def measure(pair, speculation, prompts, replicas: int, gateways: int, mode: str, max_new_tokens: int,
            requests: int, folder: pathlib.Path, per_replica: int = STREAMS_PER_REPLICA) -> dict:
    port = _free_port()
    config = _write_config(folder, pair, speculation, replicas, gateways, port)
    env = {**os.environ, "DUOSPEC_TORCH_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-m", "duospec", "serve", "--config", str(config)], env=env,
                              stdout=subprocess.DEVNULL, stderr=open(folder / f"serve-{replicas}-{gateways}.log", "w"))
    try:
        asyncio.run(_wait_serving(port, 300))
        streams = per_replica * replicas
        asyncio.run(_run_streams(port, prompts, mode, replicas * 2, 1, 8))  # warm-up: every replica, every gateway
        procs = {pid: _kind_of(cmd) for pid, cmd in _processes().items() if _kind_of(cmd)}
        procs[server.pid] = "serve (one process)" if gateways == 1 else "supervisor"
        before, cpu_client = {pid: _cpu_seconds(pid) for pid in procs}, time.process_time()
        tokens, wall = asyncio.run(_run_streams(port, prompts, mode, streams, requests, max_new_tokens))
        used = {pid: _cpu_seconds(pid) - before[pid] for pid in procs}
        client_cpu = time.process_time() - cpu_client
    finally:
        stop(server)
    shares: dict[str, list[float]] = {}
    for pid, kind in procs.items():
        shares.setdefault(kind, []).append(used[pid] / wall)
    shares["client (this benchmark)"] = [client_cpu / wall]
    return {"replicas": replicas, "gateways": gateways, "streams": streams,
            "tokens_per_s": tokens / wall, "requests": streams * requests, "tokens": tokens,
            "wall_s": wall, "shares": shares}


def stop(server: subprocess.Popen) -> None:
    """SIGTERM (the server drains), then SIGKILL after a minute."""
    server.terminate()
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        server.kill()


def simulated_pair(prefix: str, max_new_tokens: int):
    """The bundled pair replayed on SIMULATED devices in a new folder: (pair, prompts, speculation
    defaults, what the simulation is, the folder)."""
    from duospec.bench.inprocess import BenchPair, encode_prompts
    from duospec.bench.prompts import load_prompts
    from duospec.bench.simulate import build_replay_pair
    from duospec.coordinator.config import SpeculationDefaults
    from duospec.engine import load_tokenizer

    models = REPO / "models"
    speculation = SpeculationDefaults()
    prompts = encode_prompts(load_tokenizer(str(models / "target")), load_prompts(), 256)
    folder = pathlib.Path(tempfile.mkdtemp(prefix=prefix))
    target, draft, simulation = build_replay_pair(
        folder, str(models / "target"), str(models / "draft"), [p.token_ids for p in prompts], scenario="devices",
        max_new_tokens=max_new_tokens, max_draft_tokens=speculation.max_draft_tokens, gamma=speculation.gamma,
        max_lookahead=speculation.max_lookahead, progress=False)
    return BenchPair(str(target), str(draft)), prompts, speculation, simulation, folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--gateways", type=int, nargs="+", default=[2])
    parser.add_argument("--mode", default="pearl", choices=("pearl", "vanilla", "off"))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2, help="requests per stream, back to back")
    parser.add_argument("--streams-per-replica", type=int, default=STREAMS_PER_REPLICA,
                        help="client streams per replica (1: the per-token latency of one stream)")
    args = parser.parse_args(argv)

    pair, prompts, speculation, simulation, folder = simulated_pair("duospec-scale-out-", args.max_new_tokens)
    rows = [measure(pair, speculation, prompts, n, g, args.mode, args.max_new_tokens, args.requests, folder,
                    args.streams_per_replica) for g in args.gateways for n in args.replicas]
    print(f"SIMULATED devices ({simulation['what'][:90]}...), mode {args.mode}, {args.max_new_tokens} new tokens, "
          f"{args.streams_per_replica} streams per replica, {args.requests} requests each, {os.cpu_count()} cores; "
          f"logs in {folder}")
    print("| gateways | replicas | streams | tokens/s | ms per token per stream | x one replica | "
          "CPU per process kind (busiest / all, % of a core) |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    base = {}
    for r in rows:
        base.setdefault(r["gateways"], r["tokens_per_s"])
        cpu = "; ".join(f"{kind}: {100 * max(v):.0f} / {100 * sum(v):.0f}" for kind, v in sorted(r["shares"].items()))
        print(f"| {r['gateways']} | {r['replicas']} | {r['streams']} | {r['tokens_per_s']:.0f} | "
              f"{1e3 * r['streams'] / r['tokens_per_s']:.2f} | {r['tokens_per_s'] / base[r['gateways']]:.2f} | {cpu} |")
    for r in rows:
        per_token_ms = {kind: 1e3 * sum(v) * r["wall_s"] / max(1, r["tokens"]) for kind, v in r["shares"].items()}
        per_request_ms = {kind: 1e3 * sum(v) * r["wall_s"] / max(1, r["requests"]) for kind, v in r["shares"].items()}
        print(f"gateways {r['gateways']}, replicas {r['replicas']}: CPU ms per token "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per_token_ms.items()))
              + "; per request " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(per_request_ms.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
