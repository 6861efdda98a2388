"""The shared ledger and quotas on a real PostgreSQL server (tests/postgres_support.py): rows, takeovers,
gone gateways, quotas that hold across two gateways, and a database that is unreachable or lost."""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

import pytest

from duospec.cli import admin
from duospec.coordinator.tenants.admission import Admission, AdmissionError
from duospec.coordinator.tenants.ledger import RUNNING, LedgerUnavailable, UsageRecord, UsageRowTaken
from duospec.coordinator.tenants.ledgers import open_ledger, query_usage
from duospec.coordinator.tenants.tenancy import Tenant, TenantLimits
from postgres_support import PostgresServer, start_or_skip

REPO = Path(__file__).resolve().parents[2]


def record(i: int, tenant: str = "a", finished_at: float = 1000.0, status: str = "OK", tokens: int = 10,
           finish: str | None = None, started_at: float | None = None) -> UsageRecord:
    finish = finish or ("length" if status == "OK" else status)
    started_at = finished_at - 1 if started_at is None else started_at
    return UsageRecord(f"id{i}", f"r{i}", tenant, "m", 5, tokens, 8, 6, 4, 2.5, finish, status, started_at,
                       finished_at)


def running(i: int, tokens: int = 0, **kwargs) -> UsageRecord:
    return record(i, tokens=tokens, status=RUNNING, finish="running", **kwargs)


@pytest.fixture(params=["sqlite", "postgresql"])
def location(request, tmp_path):
    """Where a ledger lives: the behaviour contract is the same for both backends."""
    return str(tmp_path / "u.db") if request.param == "sqlite" else request.getfixturevalue("pg_url")


def sql(location: str, statement: str, params: tuple = ()) -> list[tuple]:
    """`statement` (`%s` placeholders) run on either ledger, as an operator's client would."""
    if location.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(location, autocommit=True) as conn:
            cur = conn.execute(statement, params)
            return cur.fetchall() if cur.description else []
    import sqlite3

    with sqlite3.connect(location) as conn:
        return conn.execute(statement.replace("%s", "?"), params).fetchall()


def test_a_row_is_written_at_admission_flushed_and_finished_in_postgres(pg_url):
    ledger = open_ledger(pg_url, flush_interval_s=3600)  # flushed by hand below
    try:
        ledger.start(running(1))
        [row] = query_usage(pg_url)
        assert (row.id, row.request_id, row.status_code, row.completion_tokens) == ("id1", "r1", RUNNING, 0)
        ledger.progress(running(1, tokens=7))
        ledger.progress(running(1, tokens=9))  # only the latest is written
        ledger.flush()
        assert query_usage(pg_url)[0].completion_tokens == 9
        ledger.progress(running(1, tokens=11))
        ledger.finish(record(1, tokens=12))
        ledger.flush()  # the finished row is not overwritten by older progress
        [row] = query_usage(pg_url, tenant="a", since=0.0)
        assert (row.completion_tokens, row.status_code, row.finish_reason) == (12, "OK", "length")
        assert query_usage(pg_url, tenant="b") == []
    finally:
        ledger.close()


def test_rows_past_the_retention_are_deleted_and_running_rows_kept_in_postgres(pg_url):
    now = time.time()
    ledger = open_ledger(pg_url, flush_interval_s=3600, retention_days=30)
    try:
        ledger.finish(record(1, finished_at=now - 40 * 86400))
        ledger.finish(record(2, finished_at=now - 10 * 86400))
        ledger.start(running(3, finished_at=now - 40 * 86400))  # a long stream
        assert ledger.expire(now) == 1
        assert sorted(r.id for r in query_usage(pg_url)) == ["id2", "id3"]
    finally:
        ledger.close()


def test_start_continues_a_row_of_the_same_tenant_and_refuses_another_tenants(location):
    first = open_ledger(location, flush_interval_s=3600)
    first.start(running(1, tokens=0, started_at=100.0))
    first.finish(record(1, tokens=5, status="CANCELLED", started_at=100.0))  # the client's stream broke
    first.close()
    resumed = open_ledger(location, flush_interval_s=3600)  # another gateway, or this one restarted
    try:
        # The client got 3 of the 5 sent: the row keeps 5 (never charged for fewer tokens than were sent).
        row = resumed.start(running(1, tokens=3, started_at=200.0, finished_at=201.0))
        assert (row.status_code, row.completion_tokens, row.started_at, row.finished_at) == (RUNNING, 5, 100.0, 201.0)
        with pytest.raises(UsageRowTaken, match="another tenant"):
            resumed.start(record(1, tenant="b", tokens=0, status=RUNNING, finish="running"))
        resumed.finish(record(1, tokens=9, started_at=200.0))  # 3 delivered + 6 new
        [row] = query_usage(location)  # one row: charged once
        assert (row.tenant, row.completion_tokens, row.status_code, row.started_at) == ("a", 9, "OK", 100.0)
    finally:
        resumed.close()


def test_a_stale_writers_late_finish_does_not_overwrite_the_row_its_stream_resumed_into(pg_url):
    old, new = open_ledger(pg_url, flush_interval_s=3600), open_ledger(pg_url, flush_interval_s=3600)
    try:
        old.start(running(1))
        new.start(running(1, tokens=4))  # the client resumed on the other gateway
        old.progress(running(1, tokens=3))
        old.flush()
        old.finish(record(1, tokens=3, status="CANCELLED"))  # the old gateway notices its client left
        [row] = query_usage(pg_url)
        assert (row.status_code, row.completion_tokens) == (RUNNING, 4)
    finally:
        old.close()
        new.close()


def test_a_gone_gateways_running_rows_are_closed_as_interrupted_and_live_ones_kept(location):
    gone, live = open_ledger(location, flush_interval_s=3600), open_ledger(location, flush_interval_s=3600)
    checker = open_ledger(location, flush_interval_s=3600)
    try:
        gone.start(running(1, tokens=4))
        live.start(running(2, tokens=6))
        assert checker.close_interrupted() == 0  # both heartbeat: nothing closed at a third gateway's start
        # (gateways on other nodes sharing PostgreSQL, or on one node sharing its SQLite file)
        sql(location, "UPDATE ledger_writers SET heartbeat_at = heartbeat_at - 31 WHERE owner = %s", (gone.owner,))
        assert checker.close_interrupted() == 1
        rows = {r.id: r for r in query_usage(location)}
        assert (rows["id1"].finish_reason, rows["id1"].status_code, rows["id1"].completion_tokens) == (
            "interrupted", "UNAVAILABLE", 4)
        assert rows["id2"].status_code == RUNNING
    finally:
        for ledger in (gone, live, checker):
            ledger.close()


def test_the_flusher_heartbeats_and_closes_gone_writers_rows_on_its_own(location, monkeypatch):
    from duospec.coordinator.tenants.ledger import UsageLedger

    monkeypatch.setattr(UsageLedger, "STALE_AFTER_S", 0.5)
    gone = open_ledger(location, flush_interval_s=3600)  # flushes never run: it stops heartbeating
    live = open_ledger(location, flush_interval_s=0.05)
    try:
        gone.start(running(1))
        live.start(running(2))
        deadline = time.monotonic() + 20
        while {r.id: r.status_code for r in query_usage(location)} != {"id1": "UNAVAILABLE", "id2": RUNNING}:
            assert time.monotonic() < deadline, query_usage(location)
            time.sleep(0.05)
    finally:
        gone.close()
        live.close()


def test_gateways_starting_together_migrate_the_schema_once(pg_url):
    from duospec.coordinator.tenants.postgres import MIGRATIONS, connect

    errors, databases = [], []

    def start():
        try:
            databases.append(connect(pg_url))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for db in databases:
        db.close()
    assert errors == []
    assert sql(pg_url, "SELECT version FROM schema_migrations ORDER BY version") == [(v,) for v, _ in MIGRATIONS]


def gateways(url: str, n: int = 2):
    """n gateways' ledgers and Admissions on one database."""
    # (their heartbeats, stamped at open, stay fresh for STALE_AFTER_S: longer than a test)
    ledgers = [open_ledger(url, flush_interval_s=3600) for _ in range(n)]
    return ledgers, [Admission(8, 8, quotas=ledger.shared_quotas()) for ledger in ledgers]


async def test_requests_per_minute_hold_across_two_gateways(pg_url):
    tenant = Tenant("a", limits=TenantLimits(requests_per_minute=3))
    ledgers, (a, b) = gateways(pg_url)
    try:
        await a.charge_request(tenant)
        await b.charge_request(tenant)
        await a.charge_request(tenant)
        for gateway in (a, b):
            with pytest.raises(AdmissionError, match="requests_per_minute") as info:
                await gateway.charge_request(tenant)
            assert 0 < info.value.retry_after_s <= 20.0  # one request refills in 60 / 3 s
        await b.charge_request(Tenant("b", limits=TenantLimits(requests_per_minute=1)))  # per tenant
    finally:
        for ledger in ledgers:
            ledger.close()


async def test_concurrent_streams_hold_across_two_gateways_and_a_gone_gateways_leases_expire(pg_url):
    tenant = Tenant("a", limits=TenantLimits(max_concurrent_streams=2))
    ledgers, (a, b) = gateways(pg_url)
    try:
        first = await a.admit(tenant, 1)
        await b.admit(tenant, 1)
        for gateway in (a, b):
            with pytest.raises(AdmissionError, match="2 open streams"):
                await gateway.admit(tenant, 1)
        a.release(first, 1)
        a.quotas.wait_released()  # (written off the event loop)
        second = await b.admit(tenant, 1)
        with pytest.raises(AdmissionError, match="open streams"):
            await b.admit(tenant, 1)
        # Gateway b crashes: its heartbeat stops, and after STALE_AFTER_S its streams stop counting.
        sql(pg_url, "UPDATE ledger_writers SET heartbeat_at = heartbeat_at - 3600 WHERE owner = %s",
            (ledgers[1].owner,))
        c_ledger = open_ledger(pg_url, flush_interval_s=3600)
        ledgers.append(c_ledger)
        c = Admission(8, 8, quotas=c_ledger.shared_quotas())
        await c.admit(tenant, 1)
        await c.admit(tenant, 1)
        assert second.lease.shared
    finally:
        for ledger in ledgers:
            ledger.close()


async def test_tokens_per_minute_are_reserved_and_refunded_across_two_gateways(pg_url):
    tenant = Tenant("a", limits=TenantLimits(tokens_per_minute=100))
    ledgers, (a, b) = gateways(pg_url)
    try:
        ticket = await a.admit(tenant, 80)
        with pytest.raises(AdmissionError, match="tokens_per_minute") as info:
            await b.admit(tenant, 30)
        assert info.value.retry_after_s == pytest.approx(6.0, abs=0.5)
        with pytest.raises(AdmissionError, match="lower stopping.max_new_tokens"):
            await b.admit(tenant, 101)
        a.release(ticket, used_tokens=20)  # 60 of the 80 reserved come back
        a.quotas.wait_released()
        await b.admit(tenant, 30)
    finally:
        for ledger in ledgers:
            ledger.close()


def test_an_unreachable_database_at_start_is_a_clear_error_with_the_password_masked():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql://duo:hunter2@127.0.0.1:{port}/x"
    with pytest.raises(LedgerUnavailable) as info:
        open_ledger(url)
    message = str(info.value)
    assert message.startswith(f"ledger postgresql://duo:***@127.0.0.1:{port}/x: ") and "refused" in message
    assert "hunter2" not in message


def test_serve_names_an_unreachable_ledger_and_exits_2_without_a_traceback(tiny_pair, tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "duospec", "serve", "--model-dir", str(tiny_pair[0].parent),
                           "--backend", "local", "--port", "0", "--metrics-port", "0", "--http-port", "0",
                           "--ledger", f"postgresql://duo:hunter2@127.0.0.1:{port}/x"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},  # this checkout's code
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"duospec serve: error: ledger postgresql://duo:***@127.0.0.1:{port}/x: " in proc.stderr
    assert "refused" in proc.stderr and "hunter2" not in proc.stderr and "Traceback" not in proc.stderr


def cli_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="duospec")
    admin.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_usage_command_reads_a_postgres_ledger(pg_url, capsys):
    ledger = open_ledger(pg_url)
    ledger.finish(record(1, "team-a", time.time()))
    ledger.close()
    assert cli_main(["usage", "--ledger", pg_url, "--since", "1h"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["TENANT", "MODEL", "REQUESTS"]
    assert out[1].split()[:6] == ["team-a", "m", "1", "0", "0", "5"]
    url_without_ledger = pg_url.rsplit("/", 1)[0] + "/postgres"
    assert cli_main(["usage", "--ledger", url_without_ledger]) == 2
    assert "no usage table" in capsys.readouterr().err


async def test_a_lost_database_keeps_serving_and_counts_the_failed_writes(tiny_pair, caplog):
    """Its own PostgreSQL server, stopped mid-test (about 3 s)."""
    from duospec.coordinator.tenants.tenancy import hash_api_key, new_api_key
    from server_support import TargetOnlyCoordinator, collect, request, running_server

    db = start_or_skip()
    key = new_api_key()
    tenant = Tenant("a", key_hashes=(hash_api_key(key),),
                    limits=TenantLimits(requests_per_minute=100, tokens_per_minute=100_000, max_concurrent_streams=4))
    try:
        url = db.create_database()
        async with running_server(TargetOnlyCoordinator(*tiny_pair), tenants=[tenant], ledger_path=url) as h:
            messages = await collect(h.stub, request("def f():", 3), api_key=key)
            assert messages[-1].usage.completion_tokens == 3
            assert [(r.tenant, r.status_code) for r in query_usage(url)] == [("a", "OK")]
            db.stop()
            for _ in range(3):  # admitted on this gateway's own budgets, served, their rows counted as lost
                messages = await collect(h.stub, request("def f():", 3), api_key=key)
                assert messages[-1].usage.completion_tokens == 3
            metrics = h.server.metrics.registry

            def count(name: str, operation: str) -> float:
                return metrics.get_sample_value(f"duospec:{name}_total", {"operation": operation}) or 0.0

            assert count("ledger_write_failures", "start") == 3 and count("ledger_write_failures", "finish") == 3
            assert count("quota_store_failures", "charge_request") == 3
            assert count("quota_store_failures", "reserve") == 3
        logged = [r.getMessage() for r in caplog.records if r.name in ("duospec.ledger", "duospec.quotas")]
        assert any("admitting on this gateway's own budgets" in line for line in logged), logged
        assert any("the start write" in line and "***" in line for line in logged), logged
    finally:
        db.remove()


def test_postgres_server_fixture_reports_why_it_cannot_start(monkeypatch):
    """No binaries: a RuntimeError saying what to install (the fixtures turn it into a skip)."""
    monkeypatch.setenv("DUOSPEC_PG_BIN", "/nonexistent")
    server = PostgresServer()
    server.bin = None
    with pytest.raises(RuntimeError, match="install postgresql"):
        server.start()
