"""`duospec serve`: the public gRPC server over a Ray pipeline (default) or an in-process coordinator.

With no arguments: local Ray, the bundled pair (models/target + models/draft, or $DUOSPEC_MODELS),
127.0.0.1:50051, auth off (loopback). Command-line flags override the config file.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
BUNDLED_MODEL_NAME = "python-tiny"


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve models over gRPC (duospec.v1.GenerationService)",
                              description=__doc__.splitlines()[0])
    p.add_argument("--host", help="bind address (default 127.0.0.1, or server.host from --config)")
    p.add_argument("--port", type=int, help="gRPC port (default 50051)")
    p.add_argument("--config", type=pathlib.Path, help="serve config, YAML or TOML (see coordinator/config.py)")
    p.add_argument("--tenants", type=pathlib.Path, help="tenants file (see `duospec tenants`); enables auth")
    p.add_argument("--http-port", type=int,
                   help="OpenAI-compatible HTTP port, /v1/completions etc. (default 8000; 0 = off)")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (default 9400; 0 = off)")
    p.add_argument("--metrics-host", type=_address,
                   help="address /metrics listens on (default 127.0.0.1 whatever --host is, or "
                        "server.metrics_host from --config)")
    p.add_argument("--address", help="Ray cluster to join (ADDR or 'auto'); default: start a local Ray")
    p.add_argument("--backend", choices=("ray", "local"), default="ray",
                   help="ray = draft/target Ray actors (default); local = in-process, no Ray (development)")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="allow serving without a tenants file on a non-loopback address")
    p.add_argument("--ledger", help="usage ledger: a SQLite path, or postgresql://user:pass@host:port/db shared by "
                                    "several gateways (default duospec-usage.db, or ledger from --config)")
    p.add_argument("--model-dir", type=pathlib.Path, help="serve one model from DIR/target (+ DIR/draft)")
    p.add_argument("--gateways", type=int, metavar="N",
                   help="gateway processes sharing the ports (default 1: one process; more run each replica's "
                        "scheduler as a Ray actor), or server.gateways from --config")
    p.add_argument("--gateway-only", action="store_true",
                   help="add gateways to a deployment already serving on the Ray cluster at --address "
                        "(another node, behind your load balancer); loads no model")
    p.add_argument("--gateway-index", type=int, default=0, help=argparse.SUPPRESS)  # set by the supervisor
    p.add_argument("--num-cpus", type=int, metavar="N",
                   help="logical CPUs of the local Ray this starts (default: the machine's cores; "
                        "server.ray_num_cpus); ignored with --address")
    p.add_argument("--grace-period", type=_grace_seconds, metavar="SECONDS",
                   help="on SIGTERM, how long in-flight streams may finish before they are cancelled "
                        "(default 10, or server.grace_period_s from --config)")
    p.set_defaults(func=run_serve)


def _address(text: str) -> str:
    if not text.strip():  # an empty bind address would mean every interface
        raise argparse.ArgumentTypeError("empty; give an address such as 127.0.0.1 or the pod IP")
    return text


def _grace_seconds(text: str) -> float:
    from duospec.coordinator.config import MAX_GRACE_PERIOD_S

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0.0 <= value <= MAX_GRACE_PERIOD_S:  # the bounds the config file accepts
        raise argparse.ArgumentTypeError(f"{text}: must be between 0 and {MAX_GRACE_PERIOD_S:g} seconds")
    return value


def run_serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from duospec.cluster.placement import PlacementError
    from duospec.coordinator.config import ConfigError
    from duospec.coordinator.models import ModelPairError
    from duospec.coordinator.tenants.tenancy import TenantsFileError
    from duospec.engine.errors import CheckpointError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_config(args)
        return asyncio.run(_serve(config, args))
    # What a user fixes in the config, the checkpoints or the cluster: the message says what, and a
    # traceback would only bury it.
    except (ConfigError, TenantsFileError, OSError, CheckpointError, ModelPairError, PlacementError) as exc:
        print(f"duospec serve: error: {exc}", file=sys.stderr)
        return 2


def build_config(args: argparse.Namespace):
    """The config file (or defaults), with command-line flags applied on top."""
    from dataclasses import replace

    from duospec.coordinator.config import DEFAULT_LEDGER, ServeConfig, ServerSettings, load_serve_config
    from duospec.coordinator.tenants.ledgers import is_postgres_url

    if args.config is not None:
        config = load_serve_config(pathlib.Path(args.config).expanduser())
    else:
        config = ServeConfig(server=ServerSettings(), models=[], ledger=str(pathlib.Path(DEFAULT_LEDGER).resolve()))
    if args.model_dir is not None or not config.models:
        config = replace(config, models=[default_model(args.model_dir)])
    server = config.server
    overrides = {"host": args.host, "port": args.port, "http_port": args.http_port, "metrics_port": args.metrics_port,
                 "metrics_host": args.metrics_host, "grace_period_s": args.grace_period,
                 "gateways": args.gateways, "ray_num_cpus": args.num_cpus}
    server = replace(server, **{k: v for k, v in overrides.items() if v is not None})
    config = replace(config, server=server)
    if args.ledger:
        ledger = args.ledger if is_postgres_url(args.ledger) else str(pathlib.Path(args.ledger).expanduser().resolve())
        config = replace(config, ledger=ledger)
    if args.tenants:
        config = replace(config, tenants=str(args.tenants.expanduser().resolve()))
    return config


def default_model(model_dir: pathlib.Path | None):
    from duospec.coordinator.config import ConfigError, ModelConfig, SpeculationDefaults
    from duospec.coordinator.api import SpeculationMode

    if model_dir is not None:
        root, name = model_dir, _model_name(model_dir)
    else:
        root, name = pathlib.Path(os.environ.get("DUOSPEC_MODELS", REPO_ROOT / "models")), BUNDLED_MODEL_NAME
    target, draft = root / "target", root / "draft"
    if not (target / "config.json").is_file():
        raise ConfigError(f"--model-dir: {target} holds no checkpoint (config.json); train the bundled pair "
                          "(`duospec train-tiny`) or pass --model-dir / --config")
    has_draft = (draft / "config.json").is_file()
    mode = SpeculationMode.PEARL if has_draft else SpeculationMode.OFF
    return ModelConfig(name=name, target=str(target.resolve()), draft=str(draft.resolve()) if has_draft else None,
                       speculation=SpeculationDefaults(mode=mode))


def _model_name(model_dir: pathlib.Path) -> str:
    import re

    name = re.sub(r"[^A-Za-z0-9._-]", "-", model_dir.resolve().name).strip("-.") or "model"
    return name[:63]


def make_coordinator(config, args: argparse.Namespace):
    if args.backend == "local":
        from duospec.coordinator.local import LocalCoordinator

        return LocalCoordinator(config.models)
    from duospec.cluster.secret import InternalTls
    from duospec.coordinator.pipeline import start_pipeline

    tls = config.server.internal_tls
    internal_tls = InternalTls.from_files(tls.cert_file, tls.key_file, tls.ca_file, tls.server_name) if tls else None
    return start_pipeline(config.models, ray_address=args.address, internal_tls=internal_tls,
                          num_cpus=config.server.ray_num_cpus or None)


async def _serve(config, args: argparse.Namespace) -> int:
    from duospec.coordinator.serving.server import check_auth_policy
    from duospec.coordinator.tenants.ledgers import check_ledger
    from duospec.coordinator.tenants.tenancy import load_tenants

    tenants = load_tenants(config.tenants) if config.tenants else None
    check_auth_policy(config.server.host, tenants, args.insecure_no_auth)  # fail before loading models
    check_ledger(config.ledger)  # (an unreachable database, too)
    if args.gateway_only:
        return await _serve_gateway(config, args, tenants)
    if config.server.gateways > 1:
        return await _serve_scaled_out(config, args)
    coordinator = await _maybe_await(make_coordinator(config, args))
    default_modes = {m.name: m.speculation.mode for m in config.models}
    return await _run_server(coordinator, config, args, tenants, default_modes, reuse_port=False, label="")


async def _run_server(coordinator, config, args, tenants, default_modes, *, reuse_port: bool, label: str) -> int:
    """Serves `coordinator` on the configured ports until SIGTERM/SIGINT (then drains)."""
    import asyncio
    import signal

    from duospec.coordinator.serving.server import DuospecServer

    server = DuospecServer(
        coordinator, config.server, tenants=tenants, insecure_no_auth=args.insecure_no_auth,
        ledger_path=config.ledger, ledger_retention_days=config.ledger_retention_days,
        default_modes=default_modes, tenants_path=config.tenants, reuse_port=reuse_port,
    )
    port = await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.shutdown()))
    loop.add_signal_handler(signal.SIGHUP, server.reload_tenants)  # tenants file: new keys, revocations
    ready = asyncio.ensure_future(server.wait_ready())
    stopped = asyncio.ensure_future(server.wait_for_termination())
    await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if ready.done():  # health is SERVING: both actors are up
        http = f", OpenAI-compatible HTTP on {config.server.host}:{server.http_port}" if server.http_port else ""
        print(f"duospec {label}serving on {config.server.host}:{port}{http}", flush=True)
    ready.cancel()
    await stopped
    return 0


async def _serve_gateway(config, args, tenants) -> int:
    """One gateway of a deployment already serving on the Ray cluster at --address."""
    from dataclasses import replace

    from duospec.cluster.runtime import connect
    from duospec.coordinator.config import ConfigError
    from duospec.coordinator.remote import RemoteCoordinator
    from duospec.coordinator.serving.gateways import set_title

    if not args.address:
        raise ConfigError("--gateway-only joins a deployment: pass --address with its Ray cluster (HOST:6379)")
    index = args.gateway_index
    set_title(index)
    connect(args.address)
    try:
        coordinator = await RemoteCoordinator.join()
    except ConnectionError as exc:
        raise ConfigError(str(exc)) from None
    server = config.server
    config = replace(config, server=replace(server, metrics_port=server.metrics_port + index if server.metrics_port else 0))
    default_modes = {name: model.config.speculation.mode for name, model in coordinator.entries.items()}
    return await _run_server(coordinator, config, args, tenants, default_modes, reuse_port=True,
                             label=f"gateway {index} ")


async def _serve_scaled_out(config, args) -> int:
    """Workers, one scheduler actor per replica, and server.gateways gateway processes on this node
    (coordinator/serving/gateways.py); this process supervises them and owns the deployment."""
    import asyncio
    import signal

    import ray

    from duospec.cluster.deployment import publish
    from duospec.coordinator.config import ConfigError
    from duospec.coordinator.serving.gateways import GatewaySupervisor, gateway_command

    if args.backend == "local":
        raise ConfigError("server.gateways > 1 runs each replica's scheduler as a Ray actor: drop --backend local, "
                          "or serve with one gateway")
    if config.server.port == 0:
        raise ConfigError("server.gateways > 1 share one gRPC port: give --port a number, not 0")
    pipeline = make_coordinator(config, args)
    published = publish(pipeline, config.models)
    address = ray.get_runtime_context().gcs_address
    n = config.server.gateways
    supervisor = GatewaySupervisor([gateway_command(args, address, i) for i in range(n)])
    supervisor.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"duospec: {n} gateways on {config.server.host}:{config.server.port} (pids "
          f"{' '.join(map(str, supervisor.pids()))}), Ray at {address}", flush=True)
    try:
        while not stop.is_set():
            supervisor.check()
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
    finally:
        await loop.run_in_executor(None, supervisor.stop, config.server.grace_period_s)
        published.shutdown()
        await pipeline.close()
    return 0


async def _maybe_await(value):
    import inspect

    return await value if inspect.isawaitable(value) else value
