"""SIGTERM to a `duospec serve --backend local` subprocess, with streams in flight.

tests/e2e/test_server_cli.py covers SIGTERM on an idle server and tests/e2e/test_server_lifecycle.py the
in-process drain; here the real process gets the signal mid-stream: in-flight streams drain within
the grace period (or end CANCELLED when it is 0), new requests during the drain get UNAVAILABLE,
health turns NOT_SERVING, the process exits 0 and the ledger has a row for every stream.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duospec.v1 import generation_pb2 as pb
from duospec.v1 import generation_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]
STREAMS = 4
NEW_TOKENS = 240


def start_serve(tiny_pair, tmp_path: Path, grace_period_s: float) -> tuple[subprocess.Popen, int]:
    target, draft = tiny_pair
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump({
        "server": {"grace_period_s": grace_period_s, "metrics_port": 0, "http_port": 0},
        "models": [{"name": "tiny", "target": str(target), "draft": str(draft), "device": "cpu"}],
        "ledger": str(tmp_path / "usage.db"),
    }))
    proc = subprocess.Popen(
        [sys.executable, "-m", "duospec", "serve", "--backend", "local", "--port", "0", "--config", str(config)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )
    line = proc.stdout.readline()
    if not line.startswith("duospec serving on 127.0.0.1:"):
        proc.kill()
        raise AssertionError(f"serve did not start: {line!r} {proc.stderr.read()}")
    return proc, int(line.rsplit(":", 1)[1])


def long_request(i: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=f"v{i} = ", request_id=f"inflight-{i}",
                              stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, ignore_eos=True))


async def read_rest(call) -> list[pb.GenerateResponse]:
    out = []
    while (m := await call.read()) is not grpc.aio.EOF:
        out.append(m)
    return out


async def sigterm_with_streams_in_flight(proc: subprocess.Popen, port: int):
    """Opens STREAMS streams, sends SIGTERM once each produced tokens, probes the drain.
    Returns (per-stream messages, code of a request made during the drain, seconds SIGTERM→NOT_SERVING)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub, health = pb_grpc.GenerationServiceStub(channel), health_pb2_grpc.HealthStub(channel)
        calls = [stub.Generate(long_request(i), timeout=120) for i in range(STREAMS)]
        firsts = [await c.read() for c in calls]
        assert all(f.token_ids for f in firsts)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        while await serving(health):
            await asyncio.sleep(0.005)
        not_serving_s = time.monotonic() - t0
        try:
            [m async for m in stub.Generate(pb.GenerateRequest(prompt="late"), timeout=10)]
            late_code = "OK"
        except grpc.aio.AioRpcError as err:
            late_code = err.code().name
        rests = await asyncio.gather(*(read_rest(c) for c in calls))
    return [[f, *rest] for f, rest in zip(firsts, rests)], late_code, not_serving_s


async def serving(health) -> bool:
    """SERVING now; a server already gone (zero grace period) counts as not serving."""
    try:
        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def ledger_rows(path: Path) -> list[tuple[str, str, int]]:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT request_id, finish_reason, completion_tokens FROM usage").fetchall()


async def test_sigterm_drains_in_flight_streams_and_refuses_new_ones(tiny_pair, tmp_path):
    proc, port = start_serve(tiny_pair, tmp_path, grace_period_s=60.0)
    try:
        streams, late_code, not_serving_s = await sigterm_with_streams_in_flight(proc, port)
        t_exit = time.monotonic()
        assert await asyncio.to_thread(proc.wait, 60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert late_code == "UNAVAILABLE"
    assert not_serving_s < 10.0, not_serving_s  # typically ms; generous for a loaded CI machine
    for messages in streams:  # every in-flight stream finished normally, all its tokens delivered
        assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(m.token_ids) for m in messages) == NEW_TOKENS
    assert time.monotonic() - t_exit < 30
    rows = {r[0]: r for r in ledger_rows(tmp_path / "usage.db")}
    assert all(rows[f"inflight-{i}"][1:] == ("length", NEW_TOKENS) for i in range(STREAMS)), rows


async def test_sigterm_with_zero_grace_cancels_streams_with_a_final_message(tiny_pair, tmp_path):
    proc, port = start_serve(tiny_pair, tmp_path, grace_period_s=0.0)
    try:
        streams, late_code, _ = await sigterm_with_streams_in_flight(proc, port)
        assert await asyncio.to_thread(proc.wait, 60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert late_code in ("UNAVAILABLE", "CANCELLED")  # refused while draining, or the port already closed
    for messages in streams:
        final = messages[-1]
        assert final.finish_reason == pb.FINISH_REASON_CANCELLED
        assert final.usage.completion_tokens == sum(len(m.token_ids) for m in messages) < NEW_TOKENS
    rows = ledger_rows(tmp_path / "usage.db")
    assert sorted(r[1] for r in rows if r[0].startswith("inflight-")) == ["cancelled"] * STREAMS
