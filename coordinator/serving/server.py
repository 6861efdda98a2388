"""The public gRPC server: GenerationService + grpc.health.v1 + reflection, around any Coordinator.

    server = DuospecServer(coordinator, settings, tenants=load_tenants(path), ledger_path="usage.db")  # or a postgresql:// URL
    port = await server.start()          # binds; health turns SERVING once the coordinator is ready
    await server.wait_for_termination()  # until shutdown() (SIGTERM in `duospec serve`)

Shutdown (`shutdown()`): stop admitting (new Generate calls get UNAVAILABLE, health NOT_SERVING), let
in-flight streams finish for `grace_period_s`, then end the rest with finish_reason CANCELLED, stop
the gRPC server and close the coordinator.

Tenants (`tenants_path`): the file is re-read when it changes (checked every TENANTS_POLL_S) or on
`reload_tenants()` (SIGHUP in `duospec serve`); new keys, limits and weights apply at once and the open
streams of a removed key end with UNAUTHENTICATED.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import pathlib
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from duospec.coordinator.tenants.admission import Admission
from duospec.coordinator.api import Coordinator, SpeculationMode
from duospec.coordinator.config import ConfigError, ServerSettings, TlsSettings
from duospec.coordinator.tenants.ledgers import open_ledger
from duospec.coordinator.serving.metrics import ServerMetrics
from duospec.coordinator.serving.gateway import Gateway, Lifecycle
from duospec.coordinator.serving.service import GenerationServicer
from duospec.coordinator.tenants.tenancy import Tenant, TenantRegistry, TenantsFileError, load_tenants
from duospec.v1 import generation_pb2 as pb
from duospec.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("duospec.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name
HEALTH_POLL_S = 1.0
TENANTS_POLL_S = 2.0  # how often the tenants file is checked for changes (SIGHUP reloads at once)
_HARD_STOP_WAIT_S = 5.0  # after the grace period: how long cancelled streams get to send their last message


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_auth_policy(host: str, tenants: list[Tenant] | None, insecure_no_auth: bool) -> bool:
    """Returns whether auth is on. Off is allowed on loopback, or anywhere with --insecure-no-auth."""
    if tenants is not None:
        return True
    if is_loopback(host):
        log.warning("auth is off: no tenants file, bound to loopback %s (local development)", host)
        return False
    if insecure_no_auth:
        log.warning("auth is OFF on %s (--insecure-no-auth): anyone who can reach the port can generate", host)
        return False
    raise ConfigError(
        f"server.host: {host} is not loopback and no tenants file is set; pass --tenants FILE "
        "(create one with `duospec tenants add`), bind 127.0.0.1, or pass --insecure-no-auth"
    )


def load_tokenizers(coordinator: Coordinator) -> dict[str, Any]:
    from transformers import AutoTokenizer

    return {m.name: AutoTokenizer.from_pretrained(m.target_path) for m in coordinator.models()}


def server_credentials(tls: TlsSettings) -> grpc.ServerCredentials:
    key = pathlib.Path(tls.key_file).read_bytes()
    cert = pathlib.Path(tls.cert_file).read_bytes()
    ca = pathlib.Path(tls.client_ca_file).read_bytes() if tls.client_ca_file else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


class DuospecServer:
    def __init__(
        self,
        coordinator: Coordinator,
        settings: ServerSettings,
        *,
        tenants: list[Tenant] | None = None,
        insecure_no_auth: bool = False,
        ledger_path: str | None = None,
        ledger_retention_days: float | None = None,
        metrics: ServerMetrics | None = None,
        tokenizers: dict[str, Any] | None = None,
        default_modes: dict[str, SpeculationMode] | None = None,
        health_poll_s: float = HEALTH_POLL_S,
        tenants_path: str | pathlib.Path | None = None,
        tenants_poll_s: float = TENANTS_POLL_S,
        reuse_port: bool = False,
    ):
        """`reuse_port`: share the gRPC and HTTP ports with the node's other gateways (SO_REUSEPORT,
        coordinator/serving/gateways.py); off, binding a port in use is an error."""
        auth_on = check_auth_policy(settings.host, tenants, insecure_no_auth)
        self.coordinator = coordinator
        self.settings = settings
        self.metrics = metrics or ServerMetrics()
        self.lifecycle = Lifecycle()
        # A SQLite path or a postgresql:// URL (retention: the serve config's ledger_retention_days; None keeps
        # every row). A PostgreSQL ledger also holds the tenants' budgets every gateway shares.
        self.ledger = open_ledger(ledger_path, retention_days=ledger_retention_days,
                                  on_failure=self.metrics.observe_ledger_failure) if ledger_path else None
        self.admission = Admission(settings.max_concurrent_requests, settings.max_queued_requests,
                                   model_slots={m.name: m.max_num_seqs for m in coordinator.models()},
                                   tenants=tenants or (), quotas=self.ledger and self.ledger.shared_quotas(
                                       self.metrics.observe_quota_failure))
        self.health = health.aio.HealthServicer()
        self.gateway = Gateway(
            coordinator, settings, tokenizers if tokenizers is not None else load_tokenizers(coordinator),
            registry=TenantRegistry(tenants or []) if auth_on else None,
            admission=self.admission, lifecycle=self.lifecycle, metrics=self.metrics, ledger=self.ledger,
            default_modes=default_modes,
        )
        self.servicer = GenerationServicer(self.gateway)
        self.health_poll_s = health_poll_s
        self.reuse_port = reuse_port
        self.tenants_path = pathlib.Path(tenants_path) if tenants_path and auth_on else None
        self.tenants_poll_s = tenants_poll_s
        self._tenants_stamp = _file_stamp(self.tenants_path)
        self._tenants_task: asyncio.Task | None = None
        self.port: int | None = None
        self.http_port: int | None = None  # bound HTTP port; None = HTTP off
        self._http = None
        self._serving = False
        self._server: grpc.aio.Server | None = None
        self._health_task: asyncio.Task | None = None
        self._metrics_http = None
        self._stopped = asyncio.Event()
        self._ready = asyncio.Event()

    async def start(self) -> int:
        """Binds and starts serving; returns the bound port (useful with port 0)."""
        server = grpc.aio.server(options=[("grpc.so_reuseport", int(self.reuse_port))])
        pb_grpc.add_GenerationServiceServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        address = f"{self.settings.host}:{self.settings.port}"
        try:
            if self.settings.tls is not None:
                self.port = server.add_secure_port(address, server_credentials(self.settings.tls))
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError:  # grpcio's newer way to say the port is taken (older ones return 0)
            self.port = 0
        if self.port == 0:
            raise OSError(f"could not bind {address}; is the port in use? pick another with --port")
        await self._set_health(False)
        if self.settings.http_port:
            from duospec.coordinator.serving.http_server import HttpFront, create_app

            self._http = HttpFront(create_app(self.gateway, lambda: self._serving), self.settings.host,
                                   self.settings.http_port, self.settings.tls, reuse_port=self.reuse_port)
            self.http_port = await self._http.start()
        await server.start()
        self._server = server
        if self.settings.metrics_port:
            self._metrics_http = self.metrics.serve(self.settings.metrics_port, self.settings.metrics_host)
        self._health_task = asyncio.create_task(self._health_loop())
        if self.tenants_path is not None:
            self._tenants_task = asyncio.create_task(self._watch_tenants())
        return self.port

    def reload_tenants(self) -> bool:
        """Re-reads the tenants file (SIGHUP, or its change seen by the watcher). A malformed file is
        logged and the tenants in force stay. Returns whether new tenants took effect."""
        if self.tenants_path is None:
            return False
        self._tenants_stamp = _file_stamp(self.tenants_path)
        try:
            tenants = load_tenants(self.tenants_path)
        except (TenantsFileError, OSError) as exc:
            log.error("tenants file not reloaded, the previous tenants stay in force: %s", exc)
            return False
        ended = self.gateway.reload_tenants(tenants)
        log.info("tenants reloaded from %s: %d tenants, %d streams of revoked keys ended",
                 self.tenants_path, len(tenants), ended)
        return True

    async def _watch_tenants(self) -> None:
        while True:
            await asyncio.sleep(self.tenants_poll_s)
            if _file_stamp(self.tenants_path) != self._tenants_stamp:
                self.reload_tenants()

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Returns once health is SERVING (the coordinator reported ready)."""
        await asyncio.wait_for(self._ready.wait(), timeout)

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()

    async def shutdown(self, grace_period_s: float | None = None) -> None:
        """Drain, then cancel what is left, then stop. Safe to call twice."""
        if self.lifecycle.draining:
            await self._stopped.wait()
            return
        grace = self.settings.grace_period_s if grace_period_s is None else grace_period_s
        self.lifecycle.draining = True
        self.admission.draining = True
        await self._set_health(False)
        log.info("draining: %d streams in flight, grace period %.1f s", self.lifecycle.active_streams, grace)
        try:
            await asyncio.wait_for(self.lifecycle.idle.wait(), grace)
        except asyncio.TimeoutError:
            log.warning("grace period over: cancelling %d streams", self.lifecycle.active_streams)
            self.lifecycle.hard_stop.set()
            try:
                await asyncio.wait_for(self.lifecycle.idle.wait(), _HARD_STOP_WAIT_S)
            except asyncio.TimeoutError:
                log.warning("%d streams did not end; stopping anyway", self.lifecycle.active_streams)
        await self._close()

    async def _close(self) -> None:
        for task in (self._health_task, self._tenants_task):
            if task is not None:
                task.cancel()
        if self._server is not None:
            await self._server.stop(1.0)
        if self._http is not None:
            await self._http.stop()
        if self._metrics_http is not None:
            http_server, _thread = self._metrics_http
            http_server.shutdown()
        try:
            await self.coordinator.close()
        finally:
            if self.ledger is not None:
                self.ledger.close()
            self._stopped.set()

    async def _health_loop(self) -> None:
        while True:
            ready = False
            try:
                stats = await asyncio.wait_for(self.coordinator.stats(), max(1.0, 5 * self.health_poll_s))
                self.metrics.update_from_coordinator(stats)
                ready = _coordinator_ready(stats)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # an unreachable coordinator is NOT_SERVING, not a crash
                log.warning("coordinator stats failed: %s", type(exc).__name__)
            await self._set_health(ready and not self.lifecycle.draining)
            await asyncio.sleep(self.health_poll_s)

    async def _set_health(self, serving: bool) -> None:
        self._serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", status)
        await self.health.set(SERVICE_NAME, status)
        if serving:
            self._ready.set()


def _coordinator_ready(stats: Any) -> bool:
    """`stats["ready"]` when the coordinator reports it; a coordinator that answers without it is ready."""
    if isinstance(stats, dict) and "ready" in stats:
        return bool(stats["ready"])
    return True


def _file_stamp(path: pathlib.Path | None):
    """What changes when the file is rewritten (or a Kubernetes Secret mount swaps it)."""
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino
