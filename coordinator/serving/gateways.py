"""Gateways: the processes that hold the public fronts when the front scales out (server.gateways > 1).

A gateway holds gRPC + HTTP, authentication, validation, admission, the ledger and routing — the
whole request path of coordinator/serving/gateway.py — over the replicas' scheduler actors
(coordinator/remote.py) instead of schedulers of its own. `duospec serve --gateways N` places the
workers and their schedulers, publishes the deployment (cluster/deployment.py) and runs N gateway
processes on this node, each `duospec serve --gateway-only` with the same flags; they share the gRPC
and HTTP ports (SO_REUSEPORT: the kernel spreads new connections over them, as vLLM's
--api-server-count does) and show as `duospec-gateway` in `ps`. A gateway that dies is restarted
(after RESTART_BACKOFF_S, doubling while it keeps dying young); the streams it held break, and the
SDK resumes them on another gateway. Gateway i serves /metrics on metrics_port + i.

On another node (behind the user's load balancer): `duospec serve --gateway-only --address RAY_ADDRESS
--config F` joins the same deployment.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

log = logging.getLogger("duospec.gateways")

PROCESS_TITLE = "duospec-gateway"
RESTART_BACKOFF_S = 1.0  # before restarting a gateway that died
MAX_BACKOFF_S = 30.0
YOUNG_S = 10.0  # a gateway that dies within this of its start doubles the next backoff

# `duospec serve` flags a gateway takes as they were given (its server settings, tenants, ledger)
_FORWARDED = {"host": "--host", "port": "--port", "config": "--config", "tenants": "--tenants",
              "http_port": "--http-port", "metrics_port": "--metrics-port", "metrics_host": "--metrics-host",
              "ledger": "--ledger", "model_dir": "--model-dir", "grace_period": "--grace-period"}


def gateway_command(args, address: str, index: int) -> list[str]:
    """The command line of gateway `index` joining the Ray cluster at `address` with `args`' flags."""
    argv = [sys.executable, "-m", "duospec", "serve", "--gateway-only", "--address", address,
            "--gateway-index", str(index)]
    for name, flag in _FORWARDED.items():
        value = getattr(args, name, None)
        if value is not None:
            argv += [flag, str(value)]
    if getattr(args, "insecure_no_auth", False):
        argv.append("--insecure-no-auth")
    return argv


def set_title(index: int) -> None:
    """`duospec-gateway <i>` in ps/top (the command line stays as it was in /proc/PID/cmdline's users
    that read it before)."""
    try:
        import setproctitle
    except ImportError:  # a client-only install never runs a gateway; keep the python title
        return
    setproctitle.setproctitle(f"{PROCESS_TITLE} {index}")


class _Gateway:
    def __init__(self, index: int, command: list[str]):
        self.index = index
        self.command = command
        self.process: subprocess.Popen | None = None
        self.started_at = 0.0
        self.backoff_s = RESTART_BACKOFF_S
        self.restart_at: float | None = None
        self.restarts = 0

    def start(self) -> None:
        env = {**os.environ, "DUOSPEC_GATEWAY_INDEX": str(self.index)}
        self.process = subprocess.Popen(self.command, env=env)
        self.started_at = time.monotonic()
        self.restart_at = None


class GatewaySupervisor:
    """Runs and restarts the node's gateway processes. `check()` (every second from `duospec serve`)
    restarts the dead; `stop(grace_s)` sends SIGTERM (each gateway drains for its grace period) and
    kills what is left after it."""

    def __init__(self, commands: list[list[str]]):
        self.gateways = [_Gateway(i, command) for i, command in enumerate(commands)]
        self.stopping = False

    def start(self) -> None:
        for gateway in self.gateways:
            gateway.start()

    def pids(self) -> list[int]:
        return [g.process.pid for g in self.gateways if g.process is not None and g.process.poll() is None]

    def check(self) -> None:
        now = time.monotonic()
        for g in self.gateways:
            if self.stopping or g.process is None:
                continue
            code = g.process.poll()
            if code is None:
                if now - g.started_at > YOUNG_S:
                    g.backoff_s = RESTART_BACKOFF_S
                continue
            if g.restart_at is None:
                young = now - g.started_at < YOUNG_S
                g.restart_at = now + g.backoff_s
                log.error("gateway %d (pid %d) exited with %s; restarting it in %.0f s", g.index, g.process.pid,
                          code, g.backoff_s)
                if young:
                    g.backoff_s = min(MAX_BACKOFF_S, g.backoff_s * 2)
            elif now >= g.restart_at:
                g.restarts += 1
                g.start()

    def stop(self, grace_s: float) -> None:
        self.stopping = True
        live = [g.process for g in self.gateways if g.process is not None and g.process.poll() is None]
        for process in live:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s + 10.0  # each drains for grace_s, then cancels and closes
        for process in live:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("gateway pid %d did not stop; killing it", process.pid)
                process.kill()
