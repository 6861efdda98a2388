"""`duospec generate` / `duospec models` against the scripted gRPC server of tests/e2e/test_sdk.py."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from duospec.cli import client as client_cli
from test_sdk import COMPLETION_TEXT, Abort, ScriptedServer, ScriptedServicer, completion

REPO = Path(__file__).resolve().parents[2]


def run_cli(argv: list[str]) -> int:
    """Parses with only this module's commands, so other sub-commands' imports don't matter here."""
    parser = argparse.ArgumentParser(prog="duospec")
    client_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.fixture
def server():
    with ScriptedServer(ScriptedServicer()) as srv:
        yield srv


def test_generate_streams_text_and_prints_stats(server, capsys, monkeypatch):
    monkeypatch.setenv("DUOSPEC_API_KEY", "sk-env")
    code = run_cli(["generate", "def fib", "--address", server.address, "--max-tokens", "4",
                    "--mode", "pearl", "--temperature", "0.5", "--seed", "3", "--stop", "\n\n"])
    out, err = capsys.readouterr()
    assert code == 0
    assert out == COMPLETION_TEXT + "\n"
    stats = err.strip()
    assert stats.startswith("4 tokens in ") and " tok/s" in stats
    for part in ("mean accepted 3.00", "drafted 8", "accepted 6", "pre-verify aborts 1", "finish length"):
        assert part in stats
    request = server.servicer.requests[0]
    assert request.prompt == "def fib" and request.stopping.max_new_tokens == 4
    assert request.sampling.seed == 3 and list(request.stopping.stop) == ["\n\n"]
    assert server.servicer.metadata[0]["authorization"] == "Bearer sk-env"


def test_generate_error_prints_one_line_and_exits_nonzero(server, capsys):
    server.servicer.scripts.append([Abort(grpc.StatusCode.NOT_FOUND, "model 'nope' is not served")])
    code = run_cli(["generate", "x", "--model", "nope", "--address", server.address, "--api-key", "k"])
    out, err = capsys.readouterr()
    assert code != 0 and out == ""
    assert err == "error: NOT_FOUND: model 'nope' is not served\n"


def test_generate_error_mid_stream_keeps_partial_text(server, capsys):
    server.servicer.scripts.append([completion()[0], Abort(grpc.StatusCode.UNAVAILABLE, "target actor died")])
    code = run_cli(["generate", "x", "--address", server.address])
    out, err = capsys.readouterr()
    assert code == 1
    assert out == "def \n"
    assert err == "error: UNAVAILABLE: target actor died\n"


def test_generate_reads_prompt_from_stdin(server, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", __import__("io").StringIO("def from_stdin():"))
    assert run_cli(["generate", "-", "--address", server.address]) == 0
    assert server.servicer.requests[0].prompt == "def from_stdin():"


def test_models_table_and_json(server, capsys):
    assert run_cli(["models", "--address", server.address]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["NAME", "MODE", "VOCAB", "CONTEXT"]
    assert lines[1].split()[:4] == ["python-tiny", "pearl", "4096", "1024"]
    assert lines[2].split()[:2] == ["target-only", "off"]
    # what an admin's key sees: each replica's state
    assert lines[4].split() == ["MODEL", "REPLICA", "STATE", "LIVE", "OUTSTANDING", "RESTARTS", "(T/D)", "TARGET",
                                "NODE", "DRAFT", "NODE"]
    assert lines[5].split() == ["python-tiny", "0", "serving", "3", "120", "0/0", "node-b", "node-a"]
    assert lines[6].split() == ["python-tiny", "1", "down", "0", "0", "2/0", "node-c", "node-c"]
    assert run_cli(["models", "--json", "--address", server.address]) == 0
    cards = json.loads(capsys.readouterr().out)
    assert cards[0]["draft_node_id"] == "node-a" and cards[1]["draft"] == ""
    assert [r["state"] for r in cards[0]["replicas"]] == ["serving", "down"] and cards[1]["replicas"] == []


def test_unreachable_server_is_one_line_error(capsys):
    # The CLI retries UNAVAILABLE (≤ 0.7 s of backoff); a deadline far past that keeps a sleep overshooting
    # on a loaded machine from turning the last attempt into DEADLINE_EXCEEDED. Refused at once anyway.
    code = run_cli(["models", "--address", "127.0.0.1:1", "--timeout", "30"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: UNAVAILABLE: ") and err.count("\n") == 1


def test_duospec_entry_point_generate(server):
    """The real `python -m duospec generate` (all sub-command modules must import)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "duospec", "generate", "def fib", "--address", server.address],
        capture_output=True, text=True, timeout=60, env=env, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == COMPLETION_TEXT + "\n"
    assert "tok/s" in proc.stderr and "Traceback" not in proc.stderr


def test_generate_sends_a_constraint_from_text_or_a_file(server, capsys, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    assert run_cli(["generate", "x", "--address", server.address, "--json-schema", f"@{schema}"]) == 0
    assert run_cli(["generate", "x", "--address", server.address, "--regex", "[0-9]+"]) == 0
    first, second = server.servicer.requests
    assert first.constraint.json_schema == '{"type": "object"}' and second.constraint.regex == "[0-9]+"
    with pytest.raises(SystemExit):  # argparse: one shape at a time
        run_cli(["generate", "x", "--address", server.address, "--regex", "a", "--grammar", "start: x"])
