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

from duospec.coordinator.tenants.ledger import COLUMNS, RUNNING, UsageRecord, summarize
from duospec.coordinator.tenants.ledgers import query_usage
from duospec.coordinator.tenants.ledger_sqlite import SqliteLedger
from duospec.cli import admin
from duospec.v1 import generation_pb2 as pb
from duospec.v1 import generation_pb2_grpc as pb_grpc

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO = TESTS_DIR.parent


def record(i: int, tenant: str = "a", finished_at: float = 1000.0, status: str = "OK", tokens: int = 10,
           finish: str | None = None) -> UsageRecord:
    finish = finish or ("length" if status == "OK" else status)
    return UsageRecord(f"id{i}", f"r{i}", tenant, "m", 5, tokens, 8, 6, 4, 2.5, finish, status,
                       finished_at - 1, finished_at)


def test_rows_round_trip_and_filter(tmp_path):
    ledger = SqliteLedger(tmp_path / "u.db")
    for i, (tenant, t) in enumerate([("a", 100.0), ("b", 200.0), ("a", 300.0)]):
        ledger.finish(record(i, tenant, t))
    ledger.finish(record(9, "a", 400.0, status="INTERNAL"))
    assert [r.request_id for r in query_usage(tmp_path / "u.db", tenant="a")] == ["r0", "r2", "r9"]
    assert [r.request_id for r in query_usage(tmp_path / "u.db", since=250.0)] == ["r2", "r9"]
    [a, b] = summarize(query_usage(tmp_path / "u.db"))
    assert (a["tenant"], a["requests"], a["errors"], a["completion_tokens"]) == ("a", 3, 1, 30)
    assert a["acceptance"] == pytest.approx(0.75) and a["mean_accepted_length"] == pytest.approx(2.5)
    assert b["requests"] == 1
    ledger.close()


def test_a_resumed_stream_takes_over_its_broken_streams_row(tmp_path):
    """start() is an upsert by id: the resumed stream writes the broken stream's row (started_at kept),
    charged once, never for fewer tokens than any of its streams sent."""
    ledger = SqliteLedger(tmp_path / "u.db", flush_interval_s=3600)
    ledger.start(record(1, tokens=0, status=RUNNING, finish="running", finished_at=100.0))
    ledger.finish(record(1, tokens=9, status="CANCELLED", finished_at=101.0))  # the broken stream sent 9
    ledger.start(record(1, tokens=7, status=RUNNING, finish="running", finished_at=102.0))  # client got 7
    [row] = query_usage(tmp_path / "u.db")
    assert (row.status_code, row.completion_tokens, row.started_at) == (RUNNING, 9, 99.0)
    ledger.finish(record(1, tokens=20, finished_at=103.0))  # 7 delivered + 13 new
    [row] = query_usage(tmp_path / "u.db")
    assert (row.status_code, row.completion_tokens, row.started_at, row.finished_at) == ("OK", 20, 99.0, 103.0)
    ledger.close()


def test_a_row_is_never_taken_over_by_another_tenant(tmp_path):
    ledger = SqliteLedger(tmp_path / "u.db", flush_interval_s=3600)
    ledger.finish(record(1, tenant="a", tokens=9))
    with pytest.raises(ValueError, match="another tenant"):
        ledger.start(record(1, tenant="b", tokens=0, status=RUNNING, finish="running"))
    [row] = query_usage(tmp_path / "u.db")
    assert (row.tenant, row.completion_tokens, row.status_code) == ("a", 9, "OK")
    ledger.close()


def test_a_row_exists_from_admission_and_follows_the_stream(tmp_path):
    ledger = SqliteLedger(tmp_path / "u.db", flush_interval_s=3600)  # flushed by hand below
    ledger.start(record(1, tokens=0, status=RUNNING, finish="running"))
    [row] = query_usage(tmp_path / "u.db")
    assert (row.id, row.request_id, row.status_code, row.completion_tokens) == ("id1", "r1", RUNNING, 0)
    ledger.progress(record(1, tokens=7, status=RUNNING, finish="running"))
    ledger.progress(record(1, tokens=9, status=RUNNING, finish="running"))  # only the latest is written
    ledger.flush()
    assert query_usage(tmp_path / "u.db")[0].completion_tokens == 9
    ledger.finish(record(1, tokens=12))
    ledger.flush()  # the finished row is not overwritten by older progress
    [row] = query_usage(tmp_path / "u.db")
    assert (row.completion_tokens, row.status_code, row.finish_reason) == (12, "OK", "length")
    [summary] = summarize([row, record(2, tokens=3, status=RUNNING, finish="running")])
    assert (summary["requests"], summary["running"], summary["errors"], summary["completion_tokens"]) == (2, 1, 0, 15)
    ledger.close()


def test_progress_pending_when_the_request_finishes_never_overwrites_the_final_row(tmp_path):
    ledger = SqliteLedger(tmp_path / "u.db", flush_interval_s=3600)
    ledger.start(record(1, tokens=0, status=RUNNING, finish="running"))
    ledger.progress(record(1, tokens=5, status=RUNNING, finish="running"))
    pending = dict(ledger._pending)  # a flush that took this progress just before the finish...
    ledger.finish(record(1, tokens=9))
    ledger._pending.update(pending)  # ...and writes it just after
    ledger.flush()
    [row] = query_usage(tmp_path / "u.db")
    assert (row.completion_tokens, row.status_code) == (9, "OK")
    ledger.close()


def test_rows_left_running_by_a_crash_are_closed_as_interrupted_on_reopen(tmp_path):
    ledger = SqliteLedger(tmp_path / "u.db")
    ledger.start(record(1, tokens=4, status=RUNNING, finish="running"))
    ledger.close()
    SqliteLedger(tmp_path / "u.db").close()
    [row] = query_usage(tmp_path / "u.db")
    assert (row.finish_reason, row.status_code, row.completion_tokens) == ("interrupted", "UNAVAILABLE", 4)


def test_a_ledger_from_before_row_ids_is_migrated(tmp_path):
    import sqlite3

    conn = sqlite3.connect(tmp_path / "old.db")
    columns = [c for c in UsageRecord.__dataclass_fields__ if c != "id"]
    conn.execute(f"CREATE TABLE usage ({', '.join(columns)})")
    conn.execute(f"INSERT INTO usage VALUES ({', '.join('?' * len(columns))})",
                 ("old-1", "a", "m", 5, 10, 8, 6, 4, 2.5, "length", "OK", 1.0, 2.0))
    conn.commit()
    conn.close()
    assert query_usage(tmp_path / "old.db")[0].id is None  # readable before the server migrates it
    ledger = SqliteLedger(tmp_path / "old.db")
    ledger.finish(record(1))
    ledger.close()
    assert [(r.id, r.request_id) for r in query_usage(tmp_path / "old.db")] == [(None, "old-1"), ("id1", "r1")]


def test_rows_past_the_retention_are_deleted_in_batches_and_running_rows_are_kept(tmp_path):
    import sqlite3

    from duospec.coordinator.tenants import ledger as ledger_module

    now = time.time()
    ledger = SqliteLedger(tmp_path / "u.db", flush_interval_s=3600, retention_days=30)
    ledger.finish(record(1, finished_at=now - 40 * 86400))
    ledger.finish(record(2, finished_at=now - 10 * 86400))
    ledger.start(record(3, status=RUNNING, finish="running", finished_at=now - 40 * 86400))  # a long stream
    n_old = ledger_module._RETENTION_BATCH * 2 + 7  # more than one delete's worth
    with sqlite3.connect(tmp_path / "u.db") as conn:  # one transaction: the ledger would fsync each row
        conn.executemany(f"INSERT INTO usage ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
                         [tuple(vars(record(100 + i, finished_at=now - 31 * 86400)).values()) for i in range(n_old)])
    assert ledger.expire(now) == n_old + 1
    assert sorted(r.id for r in query_usage(tmp_path / "u.db")) == ["id2", "id3"]
    ledger.close()


def test_the_retention_runs_on_its_own_once_the_ledger_is_open(tmp_path):
    ledger = SqliteLedger(tmp_path / "u.db")  # no retention: kept
    ledger.finish(record(1, finished_at=time.time() - 400 * 86400))
    ledger.close()
    assert len(query_usage(tmp_path / "u.db")) == 1
    ledger = SqliteLedger(tmp_path / "u.db", flush_interval_s=0.02, retention_days=365)
    try:
        deadline = time.monotonic() + 30
        while query_usage(tmp_path / "u.db"):
            assert time.monotonic() < deadline, "the year-old row is still there"
            time.sleep(0.02)
    finally:
        ledger.close()


async def test_ledger_writes_do_not_wait_for_the_executor_that_tokenizes(tmp_path):
    """Tokenizing runs on asyncio's default executor (asyncio.to_thread); with it fully busy, usage rows
    are still written."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor

    loop = asyncio.get_running_loop()
    busy = ThreadPoolExecutor(max_workers=1)
    loop.set_default_executor(busy)
    release = threading.Event()
    blocker = asyncio.ensure_future(asyncio.to_thread(release.wait))
    ledger = SqliteLedger(tmp_path / "u.db")
    try:
        await asyncio.wait_for(ledger.start_async(record(1, status=RUNNING, finish="running")), 30)
        await asyncio.wait_for(ledger.finish_async(record(1)), 30)
        assert not blocker.done() and query_usage(tmp_path / "u.db")[0].status_code == "OK"
    finally:
        release.set()
        await blocker
        ledger.close()


async def test_a_failing_ledger_write_is_logged_and_counted_and_the_request_served(tiny_pair, tmp_path,
                                                                                 caplog):
    import sqlite3

    from server_support import TargetOnlyCoordinator, collect, request, running_server

    path = tmp_path / "u.db"
    async with running_server(TargetOnlyCoordinator(*tiny_pair), ledger_path=str(path)) as h:
        with sqlite3.connect(path) as conn:  # what a full disk looks like to the ledger: every write fails
            for event in ("INSERT", "UPDATE"):
                conn.execute(f"CREATE TRIGGER full_{event} BEFORE {event} ON usage "
                             "BEGIN SELECT RAISE(FAIL, 'database or disk is full'); END")
        messages = await collect(h.stub, request("def f():", 3))
        assert messages[-1].usage.completion_tokens == 3 and messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
        failures = {op: h.server.metrics.registry.get_sample_value("duospec:ledger_write_failures_total",
                                                                   {"operation": op}) for op in ("start", "finish")}
    assert failures == {"start": 1.0, "finish": 1.0}
    lines = [r.getMessage() for r in caplog.records if r.name == "duospec.ledger"]
    assert any("the start write" in line and "disk is full" in line for line in lines), lines
    assert any("the finish write" in line for line in lines), lines


def cli_main(argv: list[str]) -> int:
    """Runs the admin commands alone, independent of the other CLI modules."""
    parser = argparse.ArgumentParser(prog="duospec")
    admin.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_usage_command_prints_a_table(tmp_path, capsys):
    ledger = SqliteLedger(tmp_path / "u.db")
    ledger.finish(record(1, "team-a", time.time()))
    ledger.close()
    assert cli_main(["usage", "--ledger", str(tmp_path / "u.db"), "--since", "1h"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["TENANT", "MODEL", "REQUESTS"]
    assert out[1].split()[:6] == ["team-a", "m", "1", "0", "0", "5"]
    assert cli_main(["usage", "--ledger", str(tmp_path / "missing.db")]) == 2


def test_parse_since():
    assert admin.parse_since("2h", now=10_000.0) == 10_000.0 - 7200
    with pytest.raises(ValueError, match="--since"):
        admin.parse_since("yesterday")


_SERVER_SCRIPT = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from duospec.coordinator.config import ServerSettings
from duospec.coordinator.serving.server import DuospecServer
from server_support import TargetOnlyCoordinator

async def main():
    coord = TargetOnlyCoordinator({target!r}, None, step_delay_s={step_delay_s!r})
    server = DuospecServer(coord, ServerSettings(port=0, metrics_port=0, http_port=0), ledger_path={ledger!r})
    port = await server.start()
    await server.wait_ready(30)
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


def _server_process(target, ledger_path, step_delay_s: float) -> subprocess.Popen:
    """A real server in a child process, for a real kill -9; its first stdout line is the port."""
    script = _SERVER_SCRIPT.format(tests=str(TESTS_DIR), target=str(target), ledger=str(ledger_path),
                                   step_delay_s=step_delay_s)
    return subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def test_ledger_keeps_every_finished_request_across_kill_9(tmp_path, tiny_pair):
    ledger_path = tmp_path / "usage.db"
    proc = _server_process(tiny_pair[0], ledger_path, 0.0)
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
    assert len({r.id for r in rows}) == 5
    assert all(r.completion_tokens == 3 and r.status_code == "OK" and r.tenant == "default" for r in rows)


def test_kill_9_mid_stream_leaves_a_row_with_the_tokens_delivered(tmp_path, tiny_pair):
    """The row exists from admission and is rewritten each second: a kill -9 loses at most the last second.
    The kill waits (read-only, from outside) until a flush has written the checkpoint, so a loaded
    machine whose flusher runs late cannot fail it; 200 tokens at 0.1 s a step keep the stream running."""
    ledger_path = tmp_path / "usage.db"
    proc = _server_process(tiny_pair[0], ledger_path, 0.1)
    received, checkpoint, flushed = 0, None, None
    try:
        port = int(proc.stdout.readline())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            req = pb.GenerateRequest(prompt="def f():", request_id="mid-stream",
                                     stopping=pb.StoppingCriteria(max_new_tokens=200, ignore_eos=True))
            deadline = None
            for message in stub.Generate(req, timeout=120):
                received += len(message.token_ids)
                if received >= 20 and checkpoint is None:
                    checkpoint = received  # the kill comes only once a flush has written at least this
                    deadline = time.monotonic() + 15
                if checkpoint is not None:
                    flushed = _completion_tokens(ledger_path)
                    if flushed is not None and flushed >= checkpoint:
                        os.kill(proc.pid, signal.SIGKILL)
                        break
                    assert time.monotonic() < deadline, f"no flush wrote {checkpoint} tokens within 15 s: {flushed}"
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert received < 200, "the stream finished before the kill; slow the server down"
    [row] = query_usage(ledger_path)
    assert (row.request_id, row.status_code, row.finish_reason) == ("mid-stream", RUNNING, "running")
    assert checkpoint <= row.completion_tokens <= received, (checkpoint, row.completion_tokens, received)


def _completion_tokens(ledger_path) -> int | None:
    """The running row's tokens as the server's ledger has them now; None before there is one."""
    import sqlite3

    try:
        rows = query_usage(ledger_path)
    except (FileNotFoundError, sqlite3.OperationalError):  # not created yet, or busy: try again next token
        return None
    return rows[0].completion_tokens if rows else None


async def test_a_final_row_is_written_even_when_its_stream_is_cancelled_while_the_write_waits(tmp_path):
    # A client that hangs up after its last message cancels the stream's task while its final write may
    # still be queued behind another on the ledger's one writer thread: the row must land anyway.
    import asyncio
    import dataclasses
    import threading

    ledger = SqliteLedger(tmp_path / "u.db", flush_interval_s=3600)
    now = time.time()
    rec = UsageRecord("r1", "r1", "t", "m", 5, 0, 0, 0, 0, 0.0, "running", RUNNING, now, now)
    ledger.start(rec)
    release = threading.Event()
    ledger._writer.submit(release.wait)  # the writer is busy: the final write queues behind this
    done = dataclasses.replace(rec, completion_tokens=7, finish_reason="length", status_code="OK")
    task = asyncio.create_task(ledger.finish_async(done))
    await asyncio.sleep(0.05)
    task.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    ledger.close()  # waits for the writer
    [row] = query_usage(tmp_path / "u.db")
    assert (row.completion_tokens, row.status_code) == (7, "OK")
