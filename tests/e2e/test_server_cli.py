"""`duospec serve` as a subprocess, and the `duospec tenants` admin commands."""

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
import yaml

from duospec.coordinator.tenants.tenancy import hash_api_key, load_tenants
from duospec.cli import admin
from duospec.v1 import generation_pb2 as pb
from duospec.v1 import generation_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]


def run_admin(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="duospec")
    admin.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_tenants_add_list_remove(tmp_path, capsys):
    path = tmp_path / "tenants.yaml"
    assert run_admin(["tenants", "add", "team-a", "--tenants", str(path), "--weight", "3", "--tpm", "1000",
                      "--allowed-models", "m1,m2"]) == 0
    key = capsys.readouterr().out.strip().splitlines()[-1]
    assert key.startswith("ds_") and key not in path.read_text()
    [tenant] = load_tenants(path)
    assert tenant.key_hashes == (hash_api_key(key),) and tenant.priority_weight == 3.0
    assert tenant.allowed_models == ("m1", "m2") and tenant.limits.tokens_per_minute == 1000
    assert run_admin(["tenants", "add", "team-a", "--tenants", str(path)]) == 2
    assert run_admin(["tenants", "add", "team-b", "--tenants", str(path), "--rpm", "0"]) == 2
    assert run_admin(["tenants", "add", "ops", "--tenants", str(path), "--admin"]) == 0
    capsys.readouterr()
    assert [t.admin for t in load_tenants(path)] == [False, True]
    assert run_admin(["tenants", "list", "--tenants", str(path)]) == 0
    listing = capsys.readouterr().out
    assert "team-a" in listing and "ops (admin)" in listing and "ds_" not in listing and "sha256" not in listing
    assert run_admin(["tenants", "remove", "team-a", "--tenants", str(path)]) == 0
    assert run_admin(["tenants", "remove", "ops", "--tenants", str(path)]) == 0
    assert yaml.safe_load(path.read_text()) == {"tenants": []}
    assert run_admin(["tenants", "remove", "team-a", "--tenants", str(path)]) == 2


def duospec_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "duospec", *args]


def test_serve_refuses_non_loopback_without_tenants(tiny_pair, tmp_path):
    model_dir = tiny_pair[0].parent
    proc = subprocess.run(duospec_cmd("serve", "--host", "0.0.0.0", "--model-dir", str(model_dir),
                                      "--backend", "local", "--metrics-port", "0", "--http-port", "0"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--insecure-no-auth" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("problem, message", [
    ("missing", "not a checkpoint directory (no config.json)"),
    ("tp", "tensor_parallel_size=3 does not divide"),
])
def test_serve_names_a_checkpoint_it_cannot_serve_without_a_traceback(tiny_pair, tmp_path, problem, message):
    target = str(tmp_path / "nowhere") if problem == "missing" else str(tiny_pair[0])
    model = {"name": "m", "target": target, "draft": str(tiny_pair[1])}
    if problem == "tp":
        model["tensor_parallel_size"] = 3
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump({"models": [model]}))
    proc = subprocess.run(duospec_cmd("serve", "--config", str(tmp_path / "serve.yaml"), "--backend", "local",
                                      "--port", "0", "--metrics-port", "0", "--http-port", "0"),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_serve_subprocess_streams_and_drains_on_sigterm(tiny_pair, tmp_path):
    pytest.importorskip("duospec.coordinator.local", reason="needs LocalCoordinator (the lead's coordinator/local.py)")
    model_dir = tiny_pair[0].parent
    proc = subprocess.Popen(
        duospec_cmd("serve", "--backend", "local", "--port", "0", "--metrics-port", "0", "--http-port", "0",
                    "--model-dir", str(model_dir), "--ledger", str(tmp_path / "usage.db")),
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("duospec serving on 127.0.0.1:"), (line, proc.stderr.read() if not line else "")
        port = int(line.rsplit(":", 1)[1])
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            req = pb.GenerateRequest(prompt="def f():", stopping=pb.StoppingCriteria(max_new_tokens=8,
                                                                                       ignore_eos=True))
            messages = list(stub.Generate(req, timeout=60))
            assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert sum(len(m.token_ids) for m in messages) == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_grace_period_flag_overrides_the_config(tiny_pair, tmp_path, capsys):
    from duospec.cli import build_parser
    from duospec.cli.serve import build_config

    target, draft = tiny_pair
    config_file = tmp_path / "serve.yaml"
    config_file.write_text(yaml.safe_dump({"server": {"grace_period_s": 30},
                                           "models": [{"name": "tiny", "target": str(target), "draft": str(draft)}]}))
    args = build_parser().parse_args(["serve", "--config", str(config_file), "--grace-period", "2.5"])
    assert build_config(args).server.grace_period_s == 2.5
    args = build_parser().parse_args(["serve", "--config", str(config_file)])
    assert build_config(args).server.grace_period_s == 30
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--grace-period", "-1"])
    assert "must be between 0 and 3600 seconds" in capsys.readouterr().err


def test_serve_scale_out_flags_set_the_config(tiny_pair, tmp_path):
    from duospec.cli import build_parser
    from duospec.cli.serve import build_config

    target, draft = tiny_pair
    config_file = tmp_path / "serve.yaml"
    config_file.write_text(yaml.safe_dump({"server": {"gateways": 3, "ray_num_cpus": 8},
                                           "models": [{"name": "tiny", "target": str(target), "draft": str(draft)}]}))
    server = build_config(build_parser().parse_args(["serve", "--config", str(config_file)])).server
    assert (server.gateways, server.ray_num_cpus) == (3, 8)
    args = build_parser().parse_args(["serve", "--config", str(config_file), "--gateways", "2", "--num-cpus", "6"])
    assert (build_config(args).server.gateways, build_config(args).server.ray_num_cpus) == (2, 6)


def test_serve_gateways_need_a_fixed_port_and_gateway_only_an_address(tiny_pair, tmp_path):
    model_dir = tiny_pair[0].parent
    for flags, message in ((["--gateways", "2", "--port", "0"], "give --port a number, not 0"),
                           (["--gateway-only"], "pass --address")):
        proc = subprocess.run(duospec_cmd("serve", "--model-dir", str(model_dir), "--metrics-port", "0",
                                          "--http-port", "0", "--ledger", str(tmp_path / "u.db"), *flags),
                              cwd=tmp_path, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
