"""A real two-node Ray cluster on this machine, `duospec serve` joining it, requests through the SDK.

Both nodes come from `ray start` (as on a real cluster), each declaring one logical GPU, so the
draft and the target actor can only be placed on different nodes. Every node gets its own
--temp-dir and explicit ports, so nothing collides with other Ray instances on the machine (the
shared test fixture, other test runs). Teardown signals only the processes whose command line names
this cluster's temp dir, by pid: never `ray stop`, which stops every Ray on the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
RAY_CLI = str(pathlib.Path(sys.executable).with_name("ray"))
DUOSPEC_CLI = [sys.executable, "-m", "duospec"]
WAIT_FOR_GPUS = REPO / "deploy" / "wait_for_gpus.py"

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def isolated_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    env.update(
        # Ray >= 2.5x turns token auth on when ~/.ray/auth_token exists (another local ray.init may
        # have written it); this cluster and its clients must not depend on that shared file.
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    return env


class LocalRayCluster:
    """Ray nodes started with `ray start`, all under one temp dir that names their processes."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.env = isolated_env()
        self.gcs_address = ""

    def start_head(self) -> None:
        self._ray_start("head", "--head", "--port", free_port(), "--include-dashboard", "false",
                        "--dashboard-port", free_port(), "--ray-client-server-port", free_port())
        # The address the head actually bound (its node IP, not necessarily 127.0.0.1).
        self.gcs_address = (self.root / "head" / "ray_current_cluster").read_text().strip()

    def add_node(self, name: str) -> None:
        self._ray_start(name, "--address", self.gcs_address)

    def _ray_start(self, name: str, *extra) -> None:
        cmd = [RAY_CLI, "start", "--num-cpus", "2", "--num-gpus", "1", "--temp-dir", str(self.root / name),
               "--object-store-memory", str(80 * 1024 * 1024), "--disable-usage-stats",
               "--min-worker-port", "0", "--max-worker-port", "0"]
        for flag in ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                     "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port"):
            cmd += [flag, free_port()]
        cmd = [str(c) for c in (*cmd, *extra)]
        done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"`{shlex.join(cmd)}` failed ({done.returncode}):\n{done.stderr[-3000:]}")

    def pids(self) -> list[int]:
        marker = str(self.root).encode()
        found = []
        for entry in pathlib.Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if marker in (entry / "cmdline").read_bytes():
                        found.append(int(entry.name))
                except OSError:  # exited while we looked
                    pass
        return found

    def stop(self, grace_s: float = 3.0) -> None:
        # Raylets and the GCS may sit on SIGTERM for a long while; that Ray cluster is disposable.
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.2)
        assert not self.pids(), f"Ray processes of {self.root} survived SIGKILL: {self.pids()}"


@pytest.fixture(scope="module")
def two_node_cluster():
    # Short path: Ray's unix sockets live under it and must stay below ~100 characters.
    root = pathlib.Path(tempfile.mkdtemp(prefix="dsmn-", dir="/tmp"))
    cluster = LocalRayCluster(root)
    try:
        cluster.start_head()
        cluster.add_node("node2")
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_serve_config(tmp_path_factory) -> pathlib.Path:
    """One model whose draft is the target itself: every greedy draft token should be accepted,
    so speculation visibly works across the two nodes. `device: auto` so the pair is placed on the
    nodes' (logical) GPUs, one per node; with no CUDA the actors then compute on CPU."""
    from tiny_models import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("multinode")
    checkpoint = make_tiny_checkpoint(root / "tiny", "llama", seed=3)
    config = root / "serve.yaml"
    config.write_text(
        "server: {host: 127.0.0.1}\n"
        f"ledger: {root / 'usage.db'}\n"
        "models:\n"
        f"  - {{name: tiny, target: {checkpoint}, draft: {checkpoint}, device: auto, dtype: float32}}\n"
    )
    return config


def live_nodes(cluster: LocalRayCluster) -> list[dict]:
    """The cluster's live nodes, once both logical GPUs have joined (deploy/wait_for_gpus.py)."""
    cmd = [sys.executable, str(WAIT_FOR_GPUS), "--address", cluster.gcs_address, "--gpus", "2",
           "--timeout", "60", "--poll", "0.5", "--json"]
    done = subprocess.run(cmd, env=cluster.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"wait_for_gpus failed:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout)


def wait_until_serving(address: str, server: subprocess.Popen, log: pathlib.Path, timeout_s: float) -> None:
    import duospec

    deadline = time.monotonic() + timeout_s
    with duospec.Client(address, timeout=2.0, max_retries=0) as client:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                pytest.fail(f"duospec serve exited with {server.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if client.health() == "SERVING":
                    return
            except duospec.DuospecError:
                pass  # not listening yet
            time.sleep(0.5)
    pytest.fail(f"duospec serve not SERVING after {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


@pytest.mark.slow  # two `ray start` processes and a served pair: minutes on 2 cores
@pytest.mark.timeout(900)  # the cluster's two `ray start`s (≤ 180 s each) + serving (≤ 240 s) + the calls
def test_draft_and_target_run_on_different_nodes(two_node_cluster, tiny_serve_config, tmp_path):
    import duospec

    nodes = live_nodes(two_node_cluster)
    assert len(nodes) == 2 and all(n["gpus"] == 1.0 for n in nodes), nodes
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [*DUOSPEC_CLI, "serve", "--address", two_node_cluster.gcs_address, "--host", "127.0.0.1",
           "--port", str(port), "--metrics-port", "0", "--http-port", "0", "--config", str(tiny_serve_config)]
    with log.open("w") as out:
        server = subprocess.Popen(cmd, env=two_node_cluster.env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until_serving(f"127.0.0.1:{port}", server, log, timeout_s=240)
        with duospec.Client(f"127.0.0.1:{port}", timeout=120) as client:
            [card] = client.models()
            assert card.draft_node_id and card.target_node_id, card
            assert card.draft_node_id != card.target_node_id, f"draft and target share node {card.draft_node_id}"
            assert {card.draft_node_id, card.target_node_id} == {n["node_id"] for n in nodes}
            result = client.generate("def fib(n):", max_new_tokens=12, ignore_eos=True, mode="pearl")
        assert result.finish_reason == "length" and len(result.token_ids) == 12, result
        assert result.stats.target_forwards > 0 and result.stats.accepted_tokens > 0, result.stats
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0, f"unclean exit after SIGTERM:\n{log.read_text()[-4000:]}"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_serve_fails_fast_when_no_cluster_is_reachable(tiny_serve_config):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    cmd = [*DUOSPEC_CLI, "serve", "--address", address, "--port", str(free_port()), "--metrics-port", "0", "--http-port", "0",
           "--config", str(tiny_serve_config)]
    started = time.monotonic()
    done = subprocess.run(cmd, env=isolated_env(), capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert re.search(r"no (ray )?cluster|not reachable|unreachable", output, re.I), output[-3000:]
    assert address in output, f"the error should name the address it tried:\n{output[-3000:]}"
    # Python, torch and ray imports alone take several seconds on a loaded CI machine.
    assert elapsed < 30, f"took {elapsed:.1f} s to report an unreachable cluster"
