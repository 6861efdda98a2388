"""Usage ledger: rows, summaries, `duospec usage`, and surviving a kill -9 of the server process."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from coordinator.ledger import UsageLedger, UsageRecord, query_usage, summarize
from duospec.cli import admin
from duospec.v1 import generation_pb2 as pb
from duospec.v1 import generation_pb2_grpc as pb_grpc
from test_server_support import tiny_pair  # noqa: F401  (fixture)

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent


def record(i: int, tenant: str = "a", finished_at: float = 1000.0, status: str = "OK") -> UsageRecord:
    return UsageRecord(f"r{i}", tenant, "m", 5, 10, 8, 6, 4, 2.5, "length" if status == "OK" else status, status,
                       finished_at - 1, finished_at)


def test_rows_round_trip_and_filter(tmp_path):
    ledger = UsageLedger(tmp_path / "u.db")
    for i, (tenant, t) in enumerate([("a", 100.0), ("b", 200.0), ("a", 300.0)]):
        ledger.record(record(i, tenant, t))
    ledger.record(record(9, "a", 400.0, status="INTERNAL"))
    assert [r.request_id for r in query_usage(tmp_path / "u.db", tenant="a")] == ["r0", "r2", "r9"]
    assert [r.request_id for r in query_usage(tmp_path / "u.db", since=250.0)] == ["r2", "r9"]
    [a, b] = summarize(query_usage(tmp_path / "u.db"))
    assert (a["tenant"], a["requests"], a["errors"], a["completion_tokens"]) == ("a", 3, 1, 30)
    assert a["acceptance"] == pytest.approx(0.75) and a["mean_accepted_length"] == pytest.approx(2.5)
    assert b["requests"] == 1
    ledger.close()


def cli_main(argv: list[str]) -> int:
    """Runs the admin commands alone, independent of the other CLI modules."""
    parser = argparse.ArgumentParser(prog="duospec")
    admin.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_usage_command_prints_a_table(tmp_path, capsys):
    ledger = UsageLedger(tmp_path / "u.db")
    ledger.record(record(1, "team-a", time.time()))
    ledger.close()
    assert cli_main(["usage", "--ledger", str(tmp_path / "u.db"), "--since", "1h"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["TENANT", "MODEL", "REQUESTS"]
    assert out[1].split()[:5] == ["team-a", "m", "1", "0", "5"]
    assert cli_main(["usage", "--ledger", str(tmp_path / "missing.db")]) == 2


def test_parse_since():
    assert admin.parse_since("2h", now=10_000.0) == 10_000.0 - 7200
    with pytest.raises(ValueError, match="--since"):
        admin.parse_since("yesterday")


_SERVER_SCRIPT = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from coordinator.config import ServerSettings
from coordinator.server import DuospecServer
from test_server_support import TargetOnlyCoordinator

async def main():
    coord = TargetOnlyCoordinator({target!r}, None)
    server = DuospecServer(coord, ServerSettings(port=0, metrics_port=0), ledger_path={ledger!r})
    port = await server.start()
    await server.wait_ready(30)
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def test_ledger_keeps_every_finished_request_across_kill_9(tmp_path, tiny_pair):  # noqa: F811
    ledger_path = tmp_path / "usage.db"
    script = _SERVER_SCRIPT.format(tests=str(TESTS_DIR), target=str(tiny_pair[0]), ledger=str(ledger_path))
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        port = int(proc.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            for i in range(5):
                req = pb.GenerateRequest(prompt="def f():", request_id=f"kill-{i}",
                                         stopping=pb.StoppingCriteria(max_new_tokens=3, ignore_eos=True))
                assert list(stub.Generate(req, timeout=60))[-1].finish_reason == pb.FINISH_REASON_LENGTH
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = query_usage(ledger_path)
    assert sorted(r.request_id for r in rows) == [f"kill-{i}" for i in range(5)]
    assert all(r.completion_tokens == 3 and r.status_code == "OK" and r.tenant == "default" for r in rows)
