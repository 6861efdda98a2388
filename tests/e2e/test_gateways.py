"""`duospec serve --gateways 2` for real: a supervisor process, the replicas' scheduler actors on a local
Ray, two gateway processes sharing the port. Output equals one process's in every mode; a gateway
killed with -9 under 16 seeded streams loses none of them (the SDK resumes each on the other gateway,
token for token the unbroken run), the ledger counts each request once, and the supervisor restarts
the gateway."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import yaml

import duospec
from duospec.coordinator.tenants.ledger import RUNNING
from duospec.coordinator.tenants.ledgers import query_usage
from server_support import free_port

pytestmark = [pytest.mark.slow, pytest.mark.ray]

REPO = pathlib.Path(__file__).resolve().parents[2]
MODES = ("off", "vanilla", "pearl")



def gateway_pids(parent: int) -> list[int]:
    """The supervisor's gateway children (their process title: `duospec-gateway <i>`)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            title = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if ppid == parent and title.startswith("duospec-gateway"):
            found.append(int(entry.name))
    return sorted(found)


@pytest.fixture(scope="module")
def deployment(tiny_pair, tmp_path_factory):
    target, draft = tiny_pair
    folder = tmp_path_factory.mktemp("gateways")
    port = free_port()
    config = {"server": {"host": "127.0.0.1", "port": port, "http_port": 0, "metrics_port": 0, "gateways": 2,
                         "ray_num_cpus": 6, "grace_period_s": 2},
              "ledger": str(folder / "usage.db"),
              "models": [{"name": "tiny", "target": str(target), "draft": str(draft), "device": "cpu",
                          "dtype": "float32", "replicas": 2,
                          "speculation": {"mode": "pearl", "max_draft_tokens": 4, "adaptive": False}}]}
    (folder / "serve.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([sys.executable, "-m", "duospec", "serve", "--config", str(folder / "serve.yaml")],
                            cwd=folder, env={**env, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                            stderr=open(folder / "serve.log", "w"))
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while len(gateway_pids(proc.pid)) < 2 or not _serving(address):
            assert proc.poll() is None, (folder / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (folder / "serve.log").read_text()[-3000:]
            time.sleep(1)
        yield proc, address, folder
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()


def _serving(address: str) -> bool:
    try:
        with duospec.Client(address, timeout=2) as client:
            return client.health() == "SERVING"
    except duospec.DuospecError:
        return False


def _one_process_results(tiny_pair, requests):
    """The same requests through a one-process server (in-process schedulers, same checkpoints)."""
    from server_support import running_server
    from duospec.coordinator.local import LocalCoordinator
    from pipeline_support import model_config

    target, draft = tiny_pair

    async def run():
        coordinator = LocalCoordinator([model_config("tiny", target, draft)])
        async with running_server(coordinator) as h:
            async with duospec.AsyncClient(f"127.0.0.1:{h.server.port}") as client:
                return [await _generate(client, **r) for r in requests]

    return asyncio.run(run())


async def _generate(client, **request):
    result = await client.generate(**request)
    return list(result.token_ids), result.text


def _requests(n: int, max_new_tokens: int, seeded: bool):
    return [dict(prompt=f"def f{i}(x):", max_new_tokens=max_new_tokens, ignore_eos=True, mode=MODES[i % 3],
                 **(dict(temperature=0.8, seed=100 + i) if seeded or i % 2 else {})) for i in range(n)]


def test_two_gateways_give_one_processes_output_in_every_mode(deployment, tiny_pair):
    _, address, _ = deployment
    requests = _requests(6, 24, seeded=False)

    async def run():
        clients = [duospec.AsyncClient(address, grpc_options=(("grpc.use_local_subchannel_pool", 1),))
                   for _ in range(4)]
        try:
            return await asyncio.gather(*(_generate(clients[i % 4], **r) for i, r in enumerate(requests)))
        finally:
            for c in clients:
                await c.close()

    assert asyncio.run(run()) == _one_process_results(tiny_pair, requests)


def test_a_gateway_killed_under_16_seeded_streams_loses_none(deployment):
    proc, address, folder = deployment
    requests = _requests(16, 96, seeded=True)
    with duospec.Client(address) as client:
        want = [(list(r.token_ids), r.text) for r in (client.generate(**q) for q in requests)]
    rows_before = len(query_usage(folder / "usage.db"))
    victim = gateway_pids(proc.pid)[0]
    got: list = [None] * len(requests)
    delivered = [0] * len(requests)

    async def stream(client, i):
        tokens, text = [], ""
        async for chunk in await client.generate(**requests[i], stream=True):
            tokens += chunk.token_ids
            text += chunk.text
            delivered[i] = len(tokens)
        got[i] = (tokens, text)

    async def run():
        clients = [duospec.AsyncClient(address, grpc_options=(("grpc.use_local_subchannel_pool", 1),))
                   for _ in range(8)]
        tasks = [asyncio.create_task(stream(clients[i % 8], i)) for i in range(len(requests))]
        deadline = time.monotonic() + 60
        while min(delivered) < 8:  # every stream is under way
            assert time.monotonic() < deadline, delivered
            await asyncio.sleep(0.02)
        os.kill(victim, signal.SIGKILL)
        await asyncio.gather(*tasks)
        for c in clients:
            await c.close()

    asyncio.run(run())
    assert got == want  # every stream whole, token for token (and text) the unbroken run's
    deadline = time.monotonic() + 10  # finished rows are written on the ledger's thread, just after
    while any(r.status_code == RUNNING for r in query_usage(folder / "usage.db")):
        assert time.monotonic() < deadline, query_usage(folder / "usage.db")[rows_before:]
        time.sleep(0.2)
    rows = query_usage(folder / "usage.db")[rows_before:]
    assert len(rows) == len(requests)  # each request counted once, resumed or not
    assert [(r.completion_tokens, r.status_code) for r in rows] == [(96, "OK")] * len(requests), rows
    deadline = time.monotonic() + 60  # the supervisor restarts the killed gateway
    while len(gateway_pids(proc.pid)) < 2:
        assert time.monotonic() < deadline, "the killed gateway was not restarted"
        time.sleep(0.5)
    assert victim not in gateway_pids(proc.pid)
