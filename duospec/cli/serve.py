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
    from duospec.coordinator.tenants.ledger import is_postgres_url

    if args.config is not None:
        config = load_serve_config(pathlib.Path(args.config).expanduser())
    else:
        config = ServeConfig(server=ServerSettings(), models=[], ledger=str(pathlib.Path(DEFAULT_LEDGER).resolve()))
    if args.model_dir is not None or not config.models:
        config = replace(config, models=[default_model(args.model_dir)])
    server = config.server
    overrides = {"host": args.host, "port": args.port, "http_port": args.http_port, "metrics_port": args.metrics_port,
                 "metrics_host": args.metrics_host, "grace_period_s": args.grace_period}
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
    return start_pipeline(config.models, ray_address=args.address, internal_tls=internal_tls)


async def _serve(config, args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from duospec.coordinator.serving.server import DuospecServer, check_auth_policy
    from duospec.coordinator.tenants.ledger import check_ledger
    from duospec.coordinator.tenants.tenancy import load_tenants

    tenants = load_tenants(config.tenants) if config.tenants else None
    check_auth_policy(config.server.host, tenants, args.insecure_no_auth)  # fail before loading models
    check_ledger(config.ledger)  # (an unreachable database, too)
    coordinator = await _maybe_await(make_coordinator(config, args))
    server = DuospecServer(
        coordinator, config.server, tenants=tenants, insecure_no_auth=args.insecure_no_auth,
        ledger_path=config.ledger, ledger_retention_days=config.ledger_retention_days,
        default_modes={m.name: m.speculation.mode for m in config.models}, tenants_path=config.tenants,
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
        print(f"duospec serving on {config.server.host}:{port}{http}", flush=True)
    ready.cancel()
    await stopped
    return 0


async def _maybe_await(value):
    import inspect

    return await value if inspect.isawaitable(value) else value
