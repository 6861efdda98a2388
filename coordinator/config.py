"""`duospec serve` configuration: typed, validated at load, errors that name the field and the fix.

Each key is declared once, on the dataclass field that holds it (`setting`: default, description,
bounds or choices; duospec/settings.py); the loader below reads its bounds from there, and
`duospec config-reference` prints every key (docs/configuration.md). A small file:

    server: {host: 0.0.0.0, port: 50051}
    ledger: /var/lib/duospec/usage.db        # or postgresql://duospec@db:5432/duospec (several gateways)
    models:
      - name: python-tiny                    # first model = default
        target: /opt/duospec/models/target
        draft: /opt/duospec/models/draft     # or {method: ngram}, {method: layers, layers: 4}, ...
        speculation: {mode: pearl}

YAML or TOML (chosen by the file suffix). Relative paths are resolved against the config file's folder.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from dataclasses import dataclass
from typing import Any

from duospec.cluster.placement import PLACEMENTS
from duospec.coordinator.config_fields import ConfigError, Fields, existing_file, read_mapping, resolve, resolve_model_path
from duospec.coordinator.api import MAX_DRAFT_TOKENS, SpeculationMode
from duospec.coordinator.tenants.ledgers import is_postgres_url
from duospec.engine.errors import CheckpointError
from duospec.coordinator.scheduling.kv_budget import PREFIX_CACHE_SCOPES
from duospec.coordinator.scheduling.routing import AFFINITY_SLACK_TOKENS, ROUTING_POLICIES
from duospec.draft_worker.proposer import MAX_TENSOR_PARALLEL, DraftMethod, DraftSpec, NgramOptions
from duospec.settings import REQUIRED, declared, setting
from duospec.structured.constraint import DEFAULT_COMPILE_TIMEOUT_S

DEVICES = ("auto", "cpu", "cuda")
MAX_GRACE_PERIOD_S = 3600.0  # server.grace_period_s and `duospec serve --grace-period`
DTYPES = ("auto", "float32", "bfloat16", "float16")
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
MAX_REPLICAS = 256
DEFAULT_LEDGER = "duospec-usage.db"
_PORT = {"lo": 0, "hi": 65535}


@dataclass(frozen=True)
class TlsSettings:
    cert_file: str = setting(REQUIRED, "PEM certificate the gRPC and HTTP APIs present")
    key_file: str = setting(REQUIRED, "its PEM private key")
    client_ca_file: str | None = setting(
        None, "set = mutual TLS: clients must present a certificate signed by this CA (PEM)")


@dataclass(frozen=True)
class InternalTlsSettings:
    """Mutual TLS on the coordinator-worker streams; the certificate needs the DNS SAN `server_name`."""

    cert_file: str = setting(REQUIRED, "PEM certificate the coordinator and the workers present to each other")
    key_file: str = setting(REQUIRED, "its PEM private key")
    ca_file: str = setting(REQUIRED, "PEM CA both sides verify the other's certificate against")
    server_name: str = setting("duospec-worker", "the DNS SAN the workers' certificate holds")


@dataclass(frozen=True)
class ServerSettings:
    host: str = setting("127.0.0.1", "address the gRPC and HTTP APIs listen on")
    port: int = setting(50051, "gRPC port", **_PORT)
    http_port: int = setting(8000, "the OpenAI-compatible HTTP API's port, on `host`; 0 = off", **_PORT)
    metrics_port: int = setting(9400, "Prometheus /metrics port; 0 = no metrics endpoint", **_PORT)
    # Metrics name tenants and models, so an operator opens them (KubeRay: the pod IP, behind a
    # NetworkPolicy) on purpose: loopback unless configured, whatever `host` is.
    metrics_host: str = setting("127.0.0.1", "address /metrics listens on (loopback unless set, whatever `host` is)")
    max_concurrent_requests: int = setting(64, "streams generating at once (all tenants)", lo=1, hi=1 << 20)
    max_queued_requests: int = setting(
        256, "requests waiting for a generation slot; beyond this RESOURCE_EXHAUSTED", lo=0, hi=1 << 20)
    max_new_tokens_limit: int = setting(2048, "a request asking for more is INVALID_ARGUMENT", lo=1, hi=1 << 24)
    # Compiles run off the event loop; one abandoned at the limit still ends within llguidance's own
    # fuel limits (and lands in the cache).
    grammar_compile_timeout_s: float = setting(
        DEFAULT_COMPILE_TIMEOUT_S, "how long a request's JSON schema, regex or grammar may take to compile; "
        "past it the request is INVALID_ARGUMENT (HTTP 400) naming the field", lo=0.01, hi=600.0)
    # Unset, a request without max_tokens runs to its end as OpenAI's and vLLM's do, within what the
    # operator and the tenant allow; a fixed number here cuts every such answer at that length.
    default_max_new_tokens: int | None = setting(
        None, "used when a request leaves max_new_tokens unset (0); absent: the room left in the model's "
        "context, up to max_new_tokens_limit and the tenant's max_tokens_per_request", lo=1, hi=1 << 24)
    grace_period_s: float = setting(
        10.0, "SIGTERM: how long in-flight streams may finish before they are cancelled", lo=0.0, hi=MAX_GRACE_PERIOD_S)
    # Browsers call an API of another origin only where it says they may (a web UI served elsewhere);
    # API keys ride in a header, not cookies, so "*" opens no session to other sites.
    cors_allow_origins: str | None = setting(
        None, "origins a browser may call the HTTP API from, comma-separated (https://ui.example.com), or *; "
        "absent: no CORS headers (browsers refuse cross-origin calls)")
    # nginx's send_timeout: a client that stopped reading fills the connection's buffers; past this
    # its stream ends as a cancelled one does, giving its KV slots and admission ticket back.
    send_timeout_s: float = setting(
        30.0, "how long a stream waits for its client to take the next message; past it the stream ends "
        "and frees its slots", lo=1.0, hi=3600.0)
    # As gRPC's default 4 MiB message limit; a longer body is never read whole.
    max_request_body_bytes: int = setting(
        4 << 20, "largest HTTP request body; a longer one gets 413 as soon as its Content-Length, or the "
        "bytes read so far, pass it", lo=1024, hi=1 << 30)
    # Usage ids are signed with it, so that a resume names a stream of the same request and tenant
    # (coordinator/serving/resume.py); gateways that share one address or one list must share it.
    resume_secret_file: str | None = setting(
        None, "file whose bytes sign the usage ids that resume broken streams; every gateway of a deployment "
        "reads the same one; absent = a random secret per process (a stream then resumes only on its own "
        "process)")
    tls: TlsSettings | None = setting(None, "TLS on the gRPC and HTTP APIs; absent = plaintext")
    internal_tls: InternalTlsSettings | None = setting(
        None, "mutual TLS between the coordinator and the workers; absent = plaintext")
    # One process (1) keeps the replicas' schedulers in the server itself, as on a laptop; more run
    # each replica's scheduler as a Ray actor and that many gateway processes sharing the ports
    # (coordinator/serving/gateways.py).
    gateways: int = setting(
        1, "gateway processes on this node sharing the gRPC and HTTP ports (SO_REUSEPORT); 1 = one process "
        "with everything in it; more: each replica's scheduler runs as a Ray actor", lo=1, hi=64)
    ray_num_cpus: int = setting(
        0, "logical CPUs the local Ray started by `duospec serve` declares; 0 = the machine's cores. Raise it to "
        "try a TP=2 target with a draft, or several replicas, on a small machine", lo=0, hi=1 << 16)


@dataclass(frozen=True)
class SpeculationDefaults:
    mode: SpeculationMode = setting(
        SpeculationMode.PEARL, "pearl: draft and target overlap; vanilla: γ drafts, then a verify, in turn; "
        "off: the target alone. A request may ask for another; without a draft, off",
        choices=[m.value for m in SpeculationMode])
    # Above vanilla's γ because pearl drafts while the target verifies: a longer chunk costs it no
    # waiting, only verify rows (on a GPU nearly free); the adaptive length (coordinator/scheduling/adaptive.py)
    # picks fewer when the verify cost and the acceptance say so.
    max_draft_tokens: int = setting(
        8, "pearl: the most drafts one verify takes (the adaptive length picks fewer when they do not pay)",
        lo=1, hi=MAX_DRAFT_TOKENS)
    max_lookahead: int = setting(9, "pearl: how far past the committed text the drafter may run", lo=1, hi=1024)
    adaptive: bool = setting(True, "pearl: adapt the draft length to acceptance and load")
    cache: bool = setting(
        True, "pearl: the speculation cache: the drafter hedges the likeliest verdicts in its spare steps; "
        "a verdict that hits one skips the pipeline drain")
    hedges: int = setting(4, "pearl: hedges per sequence in the speculation cache", lo=1, hi=16)
    tree: bool = setting(
        True, "pearl, greedy: verify the cached hedges as token-tree branches next to the main chain, in the "
        "same forward; needs the cache")
    tree_nodes: int = setting(8, "pearl, greedy: the most extra tokens the tree branches add per verify", lo=1, hi=64)
    # The rounds without a draft: before a restarted drafter's first, or while the goodput guard pauses it
    # (coordinator/scheduling/lookup.py).
    lookup: bool = setting(
        True, "pearl, greedy: a round without a draft verifies what followed the sequence's last tokens "
        "where they occurred before in its own text")
    gamma: int = setting(4, "vanilla: the textbook baseline's fixed drafts per verify (γ)", lo=1, hi=MAX_DRAFT_TOKENS)

    @property
    def request_cap(self) -> int:
        """The most drafts per verify a request may ask for, in any mode (ModelInfo.max_draft_tokens)."""
        return max(self.max_draft_tokens, self.gamma)

    def draft_tokens(self, mode: SpeculationMode) -> int:
        """A request's drafts per verify when it does not ask: γ in vanilla, the cap in pearl."""
        return self.gamma if mode is SpeculationMode.VANILLA else self.max_draft_tokens


@dataclass(frozen=True)
class ModelConfig:
    name: str = setting(REQUIRED, "the model's name in requests; letters, digits, '.', '_', '-'")
    target: str = setting(REQUIRED, "the target checkpoint: a directory, or a hub id")
    # A DraftSpec; a plain path (str) is read as {method: model, path: ...}
    draft: DraftSpec | str | None = setting(
        None, "what drafts: a draft checkpoint's directory, or a mapping with `method:` and its options "
        "(models[].draft); absent = no drafter, mode off")
    device: str = setting("auto", "where both workers run", choices=DEVICES)
    placement: str = setting(
        "auto", "separate = a GPU each (two needed); colocated = both on one GPU; auto = separate with two "
        "GPUs, colocated with one", choices=PLACEMENTS)  # cluster/placement.py
    dtype: str = setting("auto", "the weights' dtype", choices=DTYPES)
    max_batch_size: int = setting(8, "sequences per verify forward", lo=1, hi=4096)
    max_num_seqs: int = setting(
        16, "live sequences at once (KV slots per worker); more wait in the server's weighted queue, and "
        "past what the KV pools hold some are preempted", lo=1, hi=4096)
    # The coordinator keeps reconnecting after it, and serves again once the worker is back.
    restart_timeout_s: float = setting(
        600.0, "how long live requests wait for a killed worker to come back (a large model's load time) "
        "before they fail with UNAVAILABLE", lo=1.0, hi=86400.0)
    # A verify outstanding this long (or many times its predicted cost, if longer), keepalive pings on
    # an internal stream unanswered for about this long, or a stalled drafter that does not answer
    # within it; the requests then go on as after a crash (coordinator/scheduling/recovery.py).
    hang_timeout_s: float = setting(
        10.0, "a worker silent this long counts as hung: Ray kills and restarts it. Keep it above the "
        "slowest legitimate forward (a prefill chunk on a cold GPU)", lo=1.0, hi=3600.0)
    prefill_chunk_tokens: int = setting(
        512, "prompt tokens per forward (both workers): long prompts are prefilled in chunks that share "
        "rounds with others' decode", lo=16, hi=1 << 20)
    # Megatron-style, one Ray actor per rank joined by torch.distributed (cluster/tp_group.py).
    tensor_parallel_size: int = setting(
        1, "the target split over this many GPUs of one node; must divide its attention and KV heads and "
        "MLP width (the model drafter's own: draft.tensor_parallel_size)", lo=1, hi=MAX_TENSOR_PARALLEL)
    # Tenancy, fair share, quotas and the ledger stay per model (coordinator/scheduling/replicas.py).
    replicas: int = setting(
        1, "independent draft/target pairs of the model; each request goes to one chosen by `routing`",
        lo=1, hi=MAX_REPLICAS)
    routing: str = setting(
        "least_work", "with replicas: least_work = the serving replica with the fewest tokens still to "
        "produce; prefix_affinity = the one that last took a prompt sharing this one's leading 16-token "
        "blocks (same tenant), where its prefix cache likely holds them, unless it has over "
        f"{AFFINITY_SLACK_TOKENS:,} tokens more outstanding work than the least loaded", choices=ROUTING_POLICIES)
    placement_timeout_s: float = setting(
        30.0, "how long starting waits for each replica's GPUs to be free; on an autoscaling cluster give "
        "it the minutes a node takes to boot and join", lo=1.0, hi=86400.0)
    speculation: SpeculationDefaults = setting(
        None, "the model's speculation defaults (a mapping); a request may ask for others", factory=SpeculationDefaults)
    max_model_len: int | None = setting(
        None, "positions per sequence (prompt + output) on every layer; KV memory is sized from it. "
        "Absent = the model's max_position_embeddings", lo=2, hi=1 << 24)
    # Pools of 16-position blocks (duospec/engine/kv_memory.py); past what a pool holds, sequences are
    # preempted and resumed by recompute (coordinator/scheduling/kv_budget.py).
    kv_cache_memory_bytes: int | None = setting(
        None, "each worker's KV memory in bytes; it must hold one request of max_model_len. Absent = "
        "gpu_memory_utilization on CUDA, else max_num_seqs sequences of max_model_len (the draft's "
        "own: draft.kv_cache_memory_bytes)", lo=1 << 10, hi=1 << 50)
    # vLLM's meaning. A draft placed on its target's GPU holds max_num_seqs x max_model_len positions.
    gpu_memory_utilization: float = setting(
        0.9, "on CUDA without kv_cache_memory_bytes: the fraction of the GPU a worker may fill (weights, "
        "activations, KV blocks)", lo=0.01, hi=1.0)
    prefix_cache: str = setting(
        "tenant", "whose cached prompt blocks a request reuses: its own tenant's, every request's of the "
        "model (shared), or none", choices=PREFIX_CACHE_SCOPES)

    def __post_init__(self) -> None:
        if isinstance(self.draft, str):
            object.__setattr__(self, "draft", DraftSpec(DraftMethod.MODEL, path=self.draft))


@dataclass(frozen=True)
class ServeConfig:
    server: ServerSettings = setting(REQUIRED, "the APIs' listeners and limits (a file may leave it out)")
    models: list[ModelConfig] = setting(REQUIRED, "the served models, at least one; the first listed is the default")
    ledger: str = setting(
        DEFAULT_LEDGER, "the usage ledger (a row per request): a SQLite file for one gateway, or "
        "postgresql://user:pass@host:port/db for several, which then share the tenants' quotas too (the password "
        "may come from PGPASSWORD instead)")
    tenants: str | None = setting(
        None, "the tenants file (`duospec tenants add`); absent = auth off (loopback only, or "
        "--insecure-no-auth)")
    ledger_retention_days: float = setting(
        90.0, "usage rows finished more than this many days ago are deleted (checked hourly); 0 keeps them "
        "forever", lo=0.0, hi=36500.0)


def load_serve_config(path: str | pathlib.Path) -> ServeConfig:
    """Reads and validates a YAML (.yaml/.yml) or TOML (.toml) serve config."""
    path = pathlib.Path(path)
    raw = read_mapping(path)
    return parse_serve_config(raw, source=str(path), base_dir=path.parent)


def parse_serve_config(raw: Any, *, source: str = "config", base_dir: pathlib.Path | None = None) -> ServeConfig:
    base_dir = base_dir or pathlib.Path.cwd()
    top = Fields(raw, source, "")
    server = _parse_server(top.section("server"), base_dir)
    models_raw = top.get("models", list, required=True)
    if not models_raw:
        raise ConfigError(f"{source}: models: empty; add at least one model with `name` and `target`")
    models = [_parse_model(Fields(m, source, f"models[{i}]"), base_dir) for i, m in enumerate(models_raw)]
    seen: set[str] = set()
    for i, model in enumerate(models):
        if model.name in seen:
            raise ConfigError(f"{source}: models[{i}].name: {model.name!r} is listed twice; names must be unique")
        seen.add(model.name)
    ledger = top.setting(ServeConfig, "ledger")
    tenants = top.setting(ServeConfig, "tenants")
    retention = top.setting(ServeConfig, "ledger_retention_days")
    top.reject_unknown()
    return ServeConfig(
        server=server,
        models=models,
        ledger=ledger if is_postgres_url(ledger) else resolve(ledger, base_dir),
        tenants=resolve(tenants, base_dir) if tenants else None,
        ledger_retention_days=retention,
    )


def _certificates(f: "Fields", section: str, base_dir: pathlib.Path, cls, *,
                  files=("cert_file", "key_file"), optional_files=(), names=()):
    """An optional section of certificate files that must exist (and plain string options)."""
    fields = f.section(section, required=False)
    if fields is None:
        return None
    values = {name: existing_file(fields, name, base_dir, required=True) for name in files}
    values.update({name: existing_file(fields, name, base_dir, required=False) for name in optional_files})
    values.update({name: fields.setting(cls, name) for name in names if fields.raw.get(name) is not None})
    fields.reject_unknown()
    return cls(**values)


_SERVER_SCALARS = [f.name for f, _ in declared(ServerSettings) if f.name not in ("tls", "internal_tls")]


def _parse_server(f: "Fields", base_dir: pathlib.Path) -> ServerSettings:
    tls = _certificates(f, "tls", base_dir, TlsSettings, optional_files=("client_ca_file",))
    internal_tls = _certificates(f, "internal_tls", base_dir, InternalTlsSettings,
                                 files=("cert_file", "key_file", "ca_file"),
                                 names=("server_name",))
    scalars = {name: f.setting(ServerSettings, name) for name in _SERVER_SCALARS}
    settings = ServerSettings(**scalars, tls=tls, internal_tls=internal_tls)
    if not settings.metrics_host.strip():
        raise ConfigError(f"{f.where('metrics_host')}: empty; give the address /metrics listens on "
                          "(127.0.0.1, the address your Prometheus reaches, or 0.0.0.0 for every interface)")
    if settings.default_max_new_tokens is not None and settings.default_max_new_tokens > settings.max_new_tokens_limit:
        raise ConfigError(
            f"{f.where('default_max_new_tokens')}: {settings.default_max_new_tokens} is above "
            f"max_new_tokens_limit {settings.max_new_tokens_limit}; lower it or raise the limit"
        )
    f.reject_unknown()
    return settings


def _parse_model(f: "Fields", base_dir: pathlib.Path) -> ModelConfig:
    name = f.setting(ModelConfig, "name")
    if not _MODEL_NAME.match(name):
        raise ConfigError(
            f"{f.where('name')}: {name!r} is not a valid model name; use letters, digits, '.', '_', '-' "
            "(it names Ray actors duospec-target-<name>)"
        )
    target = f.setting(ModelConfig, "target")
    draft = _draft_tensor_parallel(f, _parse_draft(f, base_dir, resolve_model_path(target, base_dir)))
    spec_fields = f.section("speculation", required=False)
    spec = SpeculationDefaults()
    if spec_fields is not None:
        spec = SpeculationDefaults(**{g.name: spec_fields.setting(SpeculationDefaults, g.name)
                                      for g, _ in declared(SpeculationDefaults)})
        spec_fields.reject_unknown()
    if draft is None and spec.mode is not SpeculationMode.OFF and spec_fields is not None and "mode" in spec_fields.raw:
        raise ConfigError(
            f"{f.where('speculation.mode')}: {spec.mode.value!r} needs a draft model; add `draft:` or set mode: off"
        )
    if draft is None:
        spec = dataclasses.replace(spec, mode=SpeculationMode.OFF)
    values = {}
    for g, _ in declared(ModelConfig):
        if g.name == "tensor_parallel_size":
            values[g.name] = _tensor_parallel(f, resolve_model_path(target, base_dir), ModelConfig)
        elif g.name not in ("name", "target", "draft", "speculation"):
            values[g.name] = f.setting(ModelConfig, g.name)
    model = ModelConfig(name=name, target=resolve_model_path(target, base_dir), draft=draft, speculation=spec,
                        **values)
    f.reject_unknown()
    return model


_DRAFT_KEYS = {
    DraftMethod.MODEL: ("path", "kv_cache_memory_bytes", "tensor_parallel_size", "context_lookup",
                        "stop_confidence", "float16_products"),
    DraftMethod.LAYERS: ("layers", "path", "kv_cache_memory_bytes", "context_lookup", "stop_confidence",
                         "float16_products"),
    DraftMethod.NGRAM: ("min_ngram", "max_ngram", "max_proposal", "pool", "pool_tokens", "max_pools"),
    DraftMethod.EAGLE: ("path", "kv_cache_memory_bytes", "context_lookup", "stop_confidence"),
    DraftMethod.EAGLE3: ("path", "kv_cache_memory_bytes", "context_lookup", "stop_confidence"),
    DraftMethod.MEDUSA: ("path",),
}


def _tensor_parallel(f: "Fields", checkpoint: str | None, cls) -> int:
    """`tensor_parallel_size` of `f`'s worker (as `cls` declares it), refused with the sizes that work
    when it does not divide a local checkpoint's heads (a hub id is checked when its workers load)."""
    size = f.setting(cls, "tensor_parallel_size")
    config = _local_config(checkpoint) if size > 1 and checkpoint else None
    if config is not None and all(k in config for k in ("num_attention_heads", "intermediate_size")):
        from types import SimpleNamespace

        from duospec.engine.tensor_parallel import check_tp_size

        try:
            check_tp_size(SimpleNamespace(**config), size, checkpoint)
        except CheckpointError as exc:
            raise ConfigError(f"{f.where('tensor_parallel_size')}: {exc}") from None
    return size


def _draft_tensor_parallel(f: "Fields", draft: DraftSpec | None) -> DraftSpec | None:
    """The drafter with `draft.tensor_parallel_size` (_DRAFT_KEYS admits it for the model method only)."""
    raw = f.raw.get("draft")
    if draft is None or not isinstance(raw, dict) or raw.get("tensor_parallel_size") is None:
        return draft
    fields = Fields(raw, f.source, f"{f.prefix}.draft")
    return dataclasses.replace(draft, tensor_parallel_size=_tensor_parallel(fields, draft.path, DraftSpec))


def _parse_draft(f: "Fields", base_dir: pathlib.Path, target: str) -> DraftSpec | None:
    """`draft:` as a checkpoint path (the model drafter) or a mapping with `method:`."""
    raw = f.get("draft", (str, dict), default=None)
    if raw is None or raw == "":  # an empty path, as before the mapping form: no drafter
        return None
    if isinstance(raw, str):
        return DraftSpec(DraftMethod.MODEL, path=resolve_model_path(raw, base_dir))
    d = f.section("draft")
    methods = [m.value for m in DraftMethod]
    method_name = d.get("method", str, required=True)
    if method_name not in methods:
        raise ConfigError(f"{d.where('method')}: {method_name!r} is not a drafting method; use one of {', '.join(methods)}")
    method = DraftMethod(method_name)
    for key in d.raw:
        if key != "method" and key not in _DRAFT_KEYS[method]:
            hint = " (the n-gram drafter needs no checkpoint; remove it)" if key == "path" else ""
            raise ConfigError(
                f"{d.where(key)}: not an option of method {method.value}{hint}; its options: "
                f"{', '.join(_DRAFT_KEYS[method])}"
            )
    path = d.setting(DraftSpec, "path")
    if path == "":
        raise ConfigError(f"{d.where('path')}: empty; give the draft checkpoint's directory or remove the key")
    memory = d.setting(DraftSpec, "kv_cache_memory_bytes")
    # only the methods whose _DRAFT_KEYS list them admit these keys; the others get the defaults
    chains = {key: d.setting(DraftSpec, key) for key in ("context_lookup", "stop_confidence", "float16_products")}
    if method.loads_path:
        return DraftSpec(method, path=resolve_model_path(d.get("path", str, required=True), base_dir),
                         kv_cache_memory_bytes=memory, **chains)
    if method is DraftMethod.LAYERS:
        layers = d.setting(DraftSpec, "layers")
        if layers is None:
            raise ConfigError(f"{d.where('layers')}: missing; how many of the target's first layers draft (e.g. 4)")
        total = _local_layer_count(target)
        if total is not None and path is None and layers >= total:
            raise ConfigError(
                f"{d.where('layers')}: {layers}, but the target has {total} layers; a shallow draft uses fewer "
                f"(e.g. layers: {max(1, total // 2)})"
            )
        return DraftSpec(method, path=resolve_model_path(path, base_dir) if path else None, layers=layers,
                         kv_cache_memory_bytes=memory, **chains)
    options = NgramOptions(**{g.name: d.setting(NgramOptions, g.name) for g, _ in declared(NgramOptions)})
    if options.min_ngram > options.max_ngram:
        raise ConfigError(
            f"{d.where('min_ngram')}: {options.min_ngram} is above max_ngram {options.max_ngram}; lower it"
        )
    return DraftSpec(method, ngram=options)


def draft_from_flag(value: str, path: str | None) -> DraftSpec:
    """`--draft-method model|ngram|layers:K` (bench and CLI) as a DraftSpec; `path` is the draft
    checkpoint (model: required; layers: a fine-tuned shallow draft, optional; ngram: none).
    ValueError names the flag and the fix."""
    name, _, arg = value.partition(":")
    if name == "model" and not arg:
        if not path:
            raise ValueError("--draft-method model needs a draft checkpoint: pass --draft DIR (or --models DIR)")
        return DraftSpec(DraftMethod.MODEL, path=path)
    if name == "ngram" and not arg:
        if path:
            raise ValueError("--draft-method ngram loads no draft checkpoint; drop --draft")
        return DraftSpec(DraftMethod.NGRAM)
    if name == "layers" and arg.isdigit() and int(arg) >= 1:
        return DraftSpec(DraftMethod.LAYERS, layers=int(arg), path=path or None)
    if name in ("eagle", "eagle3", "medusa") and not arg:
        if not path:
            raise ValueError(f"--draft-method {name} needs the head's directory (duospec train-heads): pass --draft DIR")
        return DraftSpec(DraftMethod(name), path=path)
    raise ValueError(f"--draft-method {value!r}: use model, ngram, eagle, eagle3, medusa or layers:K (K >= 1, e.g. layers:2)")


def _local_layer_count(target: str) -> int | None:
    """The target's num_hidden_layers when it is a local checkpoint (None for a hub id)."""
    value = (_local_config(target) or {}).get("num_hidden_layers")
    return value if isinstance(value, int) else None


def _local_config(checkpoint: str) -> dict | None:
    """A local checkpoint's config.json (None for a hub id or an unreadable file)."""
    import json

    try:
        config = json.loads((pathlib.Path(checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None
