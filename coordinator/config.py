"""`duospec serve` configuration: typed, validated at load, errors that name the field and the fix.

    server:   {host: 0.0.0.0, port: 50051, http_port: 8000 (OpenAI-compatible HTTP; 0 = off), metrics_port: 9400,
               metrics_host: 127.0.0.1, max_concurrent_requests: 64,
               max_queued_requests: 256, max_new_tokens_limit: 2048, grace_period_s: 10,
               send_timeout_s: 30,   # a stream whose client reads nothing this long ends, freeing its slots
               max_request_body_bytes: 4194304,  # HTTP bodies past this get 413, checked while reading
               tls: {cert_file: ..., key_file: ..., client_ca_file: ...},
               internal_tls: {cert_file: ..., key_file: ..., ca_file: ..., server_name: duospec-worker}}
                                             # internal_tls: mutual TLS between coordinator and workers
    ledger: /var/lib/duospec/usage.db
    ledger_retention_days: 90                # rows older than this are deleted (hourly); 0 = keep forever
    tenants: /etc/duospec/tenants.yaml       # optional; see coordinator/tenancy.py
    models:
      - name: python-tiny                    # first model = default
        target: /opt/duospec/models/target
        draft: /opt/duospec/models/draft     # optional; no draft -> only mode off. Or a mapping:
                                             #   {method: model, path: DIR, tensor_parallel_size: 1}
                                             #   {method: layers, layers: K, path: DIR?}  target's first K layers
                                             #   {method: eagle, path: DIR} / {method: medusa, path: DIR}
                                             #     a head from `duospec train-heads` on the target's features
                                             #   {method: ngram, min_ngram: 2, max_ngram: 8, max_proposal: 16,
                                             #    pool: tenant|sequence, pool_tokens: 16000, max_pools: 16}
        device: auto                         # auto|cpu|cuda
        placement: auto                      # auto|separate|colocated: separate = a GPU each (two
                                             # needed); colocated = both on one GPU; auto = separate
                                             # with two GPUs, colocated with one
        dtype: auto                          # auto|float32|bfloat16|float16
        max_batch_size: 8                    # sequences per verify forward
        max_num_seqs: 16                     # live sequences (KV slots per worker); more wait in the
                                             # server's weighted queue
        restart_timeout_s: 600               # how long live requests wait for a restarted worker (a large
                                             # model's load time); the server keeps reconnecting past it
        hang_timeout_s: 10                   # a worker silent this long (a verify far past its cost, unanswered
                                             # keepalive pings) counts as hung: Ray kills and restarts it
        prefill_chunk_tokens: 512            # prompt tokens per forward (both workers): long prompts are
                                             # prefilled in chunks that share rounds with others' decode
        tensor_parallel_size: 1              # the target split over this many GPUs of one node (a Ray actor
                                             # per rank); the model drafter's own: draft: {..., tensor_parallel_size}
        replicas: 1                          # independent draft/target pairs of the model; each request goes
                                             # to the one with the least outstanding work
        placement_timeout_s: 30              # how long each replica's GPUs may take to be free (an
                                             # autoscaling cluster adds a node meanwhile)
        kv_cache_memory_bytes: 4294967296    # optional; KV memory of each worker (a pool of 16-position
                                             # blocks); the draft may get its own: draft: {..., kv_cache_memory_bytes}
        gpu_memory_utilization: 0.9          # on CUDA without kv_cache_memory_bytes: the fraction of the GPU
                                             # a worker may fill (weights, activations, KV blocks)
        prefix_cache: tenant                 # tenant|shared|off: whose cached prompt blocks a request reuses
        max_model_len: 8192                  # optional; positions per sequence (default: the model's
                                             # max_position_embeddings); KV memory is sized from it
        speculation: {mode: pearl, max_draft_tokens: 8, gamma: 4, max_lookahead: 9, adaptive: true,
                      # max_draft_tokens: pearl's most drafts per verify (its adaptive length picks
                      # fewer when they do not pay); gamma: vanilla's fixed drafts per verify
                      cache: true, hedges: 4,   # cache: the speculation cache, hedges per sequence
                      tree: true, tree_nodes: 8,  # tree: verify hedges as token-tree branches
                      lookup: true}  # lookup: a round without a draft (after a rejection, or the
                                     # drafter paused) verifies tokens found in the sequence's own text

YAML or TOML (chosen by the file suffix). Relative paths are resolved against the config file's folder.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from dataclasses import dataclass, field
from typing import Any

from duospec.cluster.placement import PLACEMENTS
from duospec.coordinator.config_fields import ConfigError, Fields, existing_file, read_mapping, resolve, resolve_model_path
from duospec.coordinator.api import MAX_DRAFT_TOKENS, SpeculationMode
from duospec.engine.errors import CheckpointError
from duospec.coordinator.kv_budget import PREFIX_CACHE_SCOPES
from duospec.draft_worker.proposer import POOL_SCOPES, DraftMethod, DraftSpec, NgramOptions

DEVICES = ("auto", "cpu", "cuda")
MAX_GRACE_PERIOD_S = 3600.0  # server.grace_period_s and `duospec serve --grace-period`
DTYPES = ("auto", "float32", "bfloat16", "float16")
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
MAX_TENSOR_PARALLEL = 64  # ranks of one worker: GPUs of one node
MAX_REPLICAS = 256


@dataclass(frozen=True)
class TlsSettings:
    cert_file: str
    key_file: str
    client_ca_file: str | None = None  # set = mutual TLS: clients must present a cert signed by it


@dataclass(frozen=True)
class InternalTlsSettings:
    """Mutual TLS on the coordinator-worker streams; the certificate needs the DNS SAN `server_name`."""

    cert_file: str
    key_file: str
    ca_file: str
    server_name: str = "duospec-worker"


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = 8000  # the OpenAI-compatible HTTP API, on `host`; 0 = off
    metrics_port: int = 9400  # 0 = no metrics endpoint
    # Where /metrics listens: loopback unless configured, whatever `host` is. Metrics name tenants and
    # models, so an operator opens them (KubeRay: the pod IP, behind a NetworkPolicy) on purpose.
    metrics_host: str = "127.0.0.1"
    max_concurrent_requests: int = 64  # streams generating at once (all tenants)
    max_queued_requests: int = 256  # waiting for a generation slot; beyond this RESOURCE_EXHAUSTED
    max_new_tokens_limit: int = 2048  # a request asking for more is INVALID_ARGUMENT
    default_max_new_tokens: int = 256  # used when a request leaves max_new_tokens at 0
    grace_period_s: float = 10.0  # SIGTERM: how long in-flight streams may finish before cancel
    # How long a stream may wait for its client to take the next message (nginx's send_timeout): a
    # client that stopped reading fills the connection's buffers, and past this its stream ends as a
    # cancelled one does, giving its KV slots and admission ticket back instead of holding them forever.
    send_timeout_s: float = 30.0
    # The largest HTTP request body accepted (bytes), as gRPC's default 4 MiB message limit: a longer
    # body gets 413 as soon as its Content-Length, or the bytes read so far, pass it (never read whole).
    max_request_body_bytes: int = 4 << 20
    tls: TlsSettings | None = None
    internal_tls: InternalTlsSettings | None = None


@dataclass(frozen=True)
class SpeculationDefaults:
    mode: SpeculationMode = SpeculationMode.PEARL
    # pearl: the most drafts one verify takes; the adaptive length (coordinator/adaptive.py) picks fewer
    # when the verify cost and the acceptance say so. Above vanilla's γ because pearl drafts while the
    # target verifies: a longer chunk costs it no waiting, only verify rows (on a GPU nearly free)
    max_draft_tokens: int = 8
    max_lookahead: int = 9
    adaptive: bool = True  # pearl: adapt the draft length to acceptance and load (coordinator/adaptive.py)
    # pearl: the speculation cache (draft_worker/hedges.py): the drafter hedges the likeliest verdicts
    # in its spare steps, up to `hedges` per sequence; a verdict that hits one skips the pipeline drain
    cache: bool = True
    hedges: int = 4
    # pearl, greedy: verify the cached hedges as token-tree branches next to the main chain, in the same
    # forward (at most tree_nodes extra tokens); needs the cache
    tree: bool = True
    tree_nodes: int = 8
    # pearl, greedy: a round sent without a draft (before the restarted drafter's first, or while the
    # goodput guard pauses it) verifies what followed the sequence's last tokens where they occurred
    # before in its text (coordinator/lookup.py)
    lookup: bool = True
    # vanilla: the textbook baseline's fixed drafts per verify (γ drafts, then the verify, in turn)
    gamma: int = 4

    @property
    def request_cap(self) -> int:
        """The most drafts per verify a request may ask for, in any mode (ModelInfo.max_draft_tokens)."""
        return max(self.max_draft_tokens, self.gamma)

    def draft_tokens(self, mode: SpeculationMode) -> int:
        """A request's drafts per verify when it does not ask: γ in vanilla, the cap in pearl."""
        return self.gamma if mode is SpeculationMode.VANILLA else self.max_draft_tokens


@dataclass(frozen=True)
class ModelConfig:
    name: str
    target: str
    # What drafts: a DraftSpec; a plain path (str) is read as {method: model, path: ...}
    draft: DraftSpec | str | None = None
    device: str = "auto"
    placement: str = "auto"  # auto | separate | colocated (cluster/placement.py)
    dtype: str = "auto"
    max_batch_size: int = 8
    max_num_seqs: int = 16  # live sequences at once (vLLM's name); past what the KV pools hold, some are preempted
    # How long live requests wait for a killed worker to come back (Ray restarts it) before they fail
    # with UNAVAILABLE; the coordinator keeps reconnecting after that, and serves again once it is back.
    restart_timeout_s: float = 600.0
    # A worker that stops answering without closing its streams (a hung GPU, a stopped process, a node
    # gone silent) counts as hung after this many seconds: a verify outstanding this long (or many
    # times its predicted cost, if longer), keepalive pings on an internal stream unanswered for about
    # this long, or a stalled drafter that does not answer within it. Ray then kills and restarts it,
    # and the requests go on as after a crash (coordinator/recovery.py). Keep it above the slowest
    # legitimate forward (a prefill chunk on a cold GPU).
    hang_timeout_s: float = 10.0
    # Prompt tokens per forward, on the target (per verify batch) and the drafter (per sequence).
    prefill_chunk_tokens: int = 512
    # The target split over this many devices of one node (Megatron-style, one Ray actor per rank,
    # joined by torch.distributed; cluster/tp_group.py); must divide its attention and KV heads and MLP
    # width. The model drafter's own size is draft.tensor_parallel_size (DraftSpec).
    tensor_parallel_size: int = 1
    # Independent draft/target pairs (or groups) of the model, placed across the cluster; each request
    # goes to the one with the least outstanding work (coordinator/replicas.py). Tenancy, fair share,
    # quotas and the ledger stay per model.
    replicas: int = 1
    # How long starting waits for each replica's placement groups (its GPUs) before failing with what
    # is missing. On an autoscaling cluster a pending group is the autoscaler's cue to add a node: give
    # it the minutes a node takes to boot and join.
    placement_timeout_s: float = 30.0
    speculation: SpeculationDefaults = field(default_factory=SpeculationDefaults)
    # Positions per sequence (prompt + output), on every layer alike: request validation, the
    # coordinator, the drafter and the target. None = the model's max_position_embeddings.
    max_model_len: int | None = None
    # Each worker's KV memory, in bytes of 16-position blocks from one pool (duospec/engine/kv_memory.py);
    # None: gpu_memory_utilization on CUDA, else max_num_seqs sequences of max_model_len positions. The
    # pool must hold one request of max_model_len; past what it holds, sequences are preempted and
    # resumed by recompute (coordinator/kv_budget.py). draft.kv_cache_memory_bytes: the draft's own.
    kv_cache_memory_bytes: int | None = None
    # On CUDA without kv_cache_memory_bytes: the fraction of the GPU's memory a worker may fill in all
    # (vLLM's meaning); its KV blocks get what its weights and everything else leave of it. A draft
    # placed on its target's GPU holds max_num_seqs x max_model_len positions instead.
    gpu_memory_utilization: float = 0.9
    # Whose cached prompt blocks a request reuses (coordinator/kv_budget.py): its own tenant's
    # (tenant), every request's of the model (shared), or none (off).
    prefix_cache: str = "tenant"

    def __post_init__(self) -> None:
        if isinstance(self.draft, str):
            object.__setattr__(self, "draft", DraftSpec(DraftMethod.MODEL, path=self.draft))


@dataclass(frozen=True)
class ServeConfig:
    server: ServerSettings
    models: list[ModelConfig]
    ledger: str
    tenants: str | None = None  # tenants file; None = auth off (loopback only, or --insecure-no-auth)
    # Usage rows finished more than this many days ago are deleted (checked hourly); 0 keeps them forever.
    ledger_retention_days: float = 90.0


DEFAULT_LEDGER = "duospec-usage.db"


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
    ledger = top.get("ledger", str, default=DEFAULT_LEDGER)
    tenants = top.get("tenants", str, default=None)
    retention = top.float_in("ledger_retention_days", 0.0, 36500.0, default=ServeConfig.ledger_retention_days)
    top.reject_unknown()
    return ServeConfig(
        server=server,
        models=models,
        ledger=resolve(ledger, base_dir),
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
    values.update({name: fields.get(name, str) for name in names if fields.raw.get(name) is not None})
    fields.reject_unknown()
    return cls(**values)


def _parse_server(f: "Fields", base_dir: pathlib.Path) -> ServerSettings:
    d = ServerSettings()
    tls = _certificates(f, "tls", base_dir, TlsSettings, optional_files=("client_ca_file",))
    internal_tls = _certificates(f, "internal_tls", base_dir, InternalTlsSettings,
                                 files=("cert_file", "key_file", "ca_file"),
                                 names=("server_name",))
    settings = ServerSettings(
        host=f.get("host", str, default=d.host),
        port=f.int_in("port", 0, 65535, default=d.port),
        http_port=f.int_in("http_port", 0, 65535, default=d.http_port),
        metrics_port=f.int_in("metrics_port", 0, 65535, default=d.metrics_port),
        metrics_host=f.get("metrics_host", str, default=d.metrics_host),
        max_concurrent_requests=f.int_in("max_concurrent_requests", 1, 1 << 20, default=d.max_concurrent_requests),
        max_queued_requests=f.int_in("max_queued_requests", 0, 1 << 20, default=d.max_queued_requests),
        max_new_tokens_limit=f.int_in("max_new_tokens_limit", 1, 1 << 24, default=d.max_new_tokens_limit),
        default_max_new_tokens=f.int_in("default_max_new_tokens", 1, 1 << 24, default=d.default_max_new_tokens),
        grace_period_s=f.float_in("grace_period_s", 0.0, MAX_GRACE_PERIOD_S, default=d.grace_period_s),
        send_timeout_s=f.float_in("send_timeout_s", 1.0, 3600.0, default=d.send_timeout_s),
        max_request_body_bytes=f.int_in("max_request_body_bytes", 1024, 1 << 30, default=d.max_request_body_bytes),
        tls=tls,
        internal_tls=internal_tls,
    )
    if not settings.metrics_host.strip():
        raise ConfigError(f"{f.where('metrics_host')}: empty; give the address /metrics listens on "
                          "(127.0.0.1, the address your Prometheus reaches, or 0.0.0.0 for every interface)")
    if settings.default_max_new_tokens > settings.max_new_tokens_limit:
        raise ConfigError(
            f"{f.where('default_max_new_tokens')}: {settings.default_max_new_tokens} is above "
            f"max_new_tokens_limit {settings.max_new_tokens_limit}; lower it or raise the limit"
        )
    f.reject_unknown()
    return settings


def _parse_model(f: "Fields", base_dir: pathlib.Path) -> ModelConfig:
    name = f.get("name", str, required=True)
    if not _MODEL_NAME.match(name):
        raise ConfigError(
            f"{f.where('name')}: {name!r} is not a valid model name; use letters, digits, '.', '_', '-' "
            "(it names Ray actors duospec-target-<name>)"
        )
    target = f.get("target", str, required=True)
    draft = _draft_tensor_parallel(f, _parse_draft(f, base_dir, resolve_model_path(target, base_dir)))
    spec_fields = f.section("speculation", required=False)
    spec = SpeculationDefaults()
    if spec_fields is not None:
        mode_name = spec_fields.choice("mode", [m.value for m in SpeculationMode], default=spec.mode.value)
        spec = SpeculationDefaults(
            mode=SpeculationMode(mode_name),
            max_draft_tokens=spec_fields.int_in("max_draft_tokens", 1, MAX_DRAFT_TOKENS, default=spec.max_draft_tokens),
            max_lookahead=spec_fields.int_in("max_lookahead", 1, 1024, default=spec.max_lookahead),
            adaptive=spec_fields.get("adaptive", bool, default=spec.adaptive),
            cache=spec_fields.get("cache", bool, default=spec.cache),
            hedges=spec_fields.int_in("hedges", 1, 16, default=spec.hedges),
            tree=spec_fields.get("tree", bool, default=spec.tree),
            tree_nodes=spec_fields.int_in("tree_nodes", 1, 64, default=spec.tree_nodes),
            lookup=spec_fields.get("lookup", bool, default=spec.lookup),
            gamma=spec_fields.int_in("gamma", 1, MAX_DRAFT_TOKENS, default=spec.gamma),
        )
        spec_fields.reject_unknown()
    if draft is None and spec.mode is not SpeculationMode.OFF and spec_fields is not None and "mode" in spec_fields.raw:
        raise ConfigError(
            f"{f.where('speculation.mode')}: {spec.mode.value!r} needs a draft model; add `draft:` or set mode: off"
        )
    if draft is None:
        spec = dataclasses.replace(spec, mode=SpeculationMode.OFF)
    model = ModelConfig(
        name=name,
        target=resolve_model_path(target, base_dir),
        draft=draft,
        device=f.choice("device", DEVICES, default="auto"),
        placement=f.choice("placement", PLACEMENTS, default="auto"),
        dtype=f.choice("dtype", DTYPES, default="auto"),
        max_batch_size=f.int_in("max_batch_size", 1, 4096, default=8),
        max_num_seqs=f.int_in("max_num_seqs", 1, 4096, default=16),
        restart_timeout_s=f.float_in("restart_timeout_s", 1.0, 86400.0, default=600.0),
        hang_timeout_s=f.float_in("hang_timeout_s", 1.0, 3600.0, default=ModelConfig.hang_timeout_s),
        prefill_chunk_tokens=f.int_in("prefill_chunk_tokens", 16, 1 << 20, default=512),
        tensor_parallel_size=_tensor_parallel(f, resolve_model_path(target, base_dir), ModelConfig.tensor_parallel_size),
        replicas=f.int_in("replicas", 1, MAX_REPLICAS, default=ModelConfig.replicas),
        placement_timeout_s=f.float_in("placement_timeout_s", 1.0, 86400.0, default=ModelConfig.placement_timeout_s),
        speculation=spec,
        max_model_len=f.int_in("max_model_len", 2, 1 << 24, default=2) if f.raw.get("max_model_len") is not None else None,
        kv_cache_memory_bytes=_memory_bytes(f),
        gpu_memory_utilization=f.float_in("gpu_memory_utilization", 0.01, 1.0,
                                          default=ModelConfig.gpu_memory_utilization),
        prefix_cache=f.choice("prefix_cache", PREFIX_CACHE_SCOPES, default=ModelConfig.prefix_cache),
    )
    f.reject_unknown()
    return model


_DRAFT_KEYS = {
    DraftMethod.MODEL: ("path", "kv_cache_memory_bytes", "tensor_parallel_size"),
    DraftMethod.LAYERS: ("layers", "path", "kv_cache_memory_bytes"),
    DraftMethod.NGRAM: ("min_ngram", "max_ngram", "max_proposal", "pool", "pool_tokens", "max_pools"),
    DraftMethod.EAGLE: ("path", "kv_cache_memory_bytes"),
    DraftMethod.MEDUSA: ("path",),
}


def _memory_bytes(f: "Fields") -> int | None:
    """An optional `kv_cache_memory_bytes` (at least one 16-position block of a tiny model)."""
    if f.raw.get("kv_cache_memory_bytes") is None:
        return None
    return f.int_in("kv_cache_memory_bytes", 1 << 10, 1 << 50, default=1 << 10)


def _tensor_parallel(f: "Fields", checkpoint: str | None, default: int) -> int:
    """`tensor_parallel_size` of `f`'s worker, refused with the sizes that work when it does not divide
    a local checkpoint's heads (a hub id is checked when its workers load)."""
    size = f.int_in("tensor_parallel_size", 1, MAX_TENSOR_PARALLEL, default=default)
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
    return dataclasses.replace(draft, tensor_parallel_size=_tensor_parallel(fields, draft.path,
                                                                            DraftSpec.tensor_parallel_size))


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
    path = d.get("path", str, default=None)
    if path == "":
        raise ConfigError(f"{d.where('path')}: empty; give the draft checkpoint's directory or remove the key")
    memory = _memory_bytes(d)
    if method in (DraftMethod.MODEL, DraftMethod.EAGLE, DraftMethod.MEDUSA):
        return DraftSpec(method, path=resolve_model_path(d.get("path", str, required=True), base_dir),
                         kv_cache_memory_bytes=memory)
    if method is DraftMethod.LAYERS:
        layers = d.int_in("layers", 1, 1 << 16, default=0) if "layers" in d.raw else None
        if layers is None:
            raise ConfigError(f"{d.where('layers')}: missing; how many of the target's first layers draft (e.g. 4)")
        total = _local_layer_count(target)
        if total is not None and path is None and layers >= total:
            raise ConfigError(
                f"{d.where('layers')}: {layers}, but the target has {total} layers; a shallow draft uses fewer "
                f"(e.g. layers: {max(1, total // 2)})"
            )
        return DraftSpec(method, path=resolve_model_path(path, base_dir) if path else None, layers=layers,
                         kv_cache_memory_bytes=memory)
    n = NgramOptions()
    options = NgramOptions(
        min_ngram=d.int_in("min_ngram", 1, 64, default=n.min_ngram),
        max_ngram=d.int_in("max_ngram", 1, 64, default=n.max_ngram),
        max_proposal=d.int_in("max_proposal", 1, 256, default=n.max_proposal),
        pool=d.choice("pool", POOL_SCOPES, default=n.pool),
        pool_tokens=d.int_in("pool_tokens", 1, 1 << 30, default=n.pool_tokens),
        max_pools=d.int_in("max_pools", 1, 1 << 20, default=n.max_pools),
    )
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
    if name in ("eagle", "medusa") and not arg:
        if not path:
            raise ValueError(f"--draft-method {name} needs the head's directory (duospec train-heads): pass --draft DIR")
        return DraftSpec(DraftMethod(name), path=path)
    raise ValueError(f"--draft-method {value!r}: use model, ngram, eagle, medusa or layers:K (K >= 1, e.g. layers:2)")


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
