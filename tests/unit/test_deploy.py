"""The deployment files agree with Ray, KubeRay, the CLI and each other.

- deploy/cluster*.yaml pass Ray's own `prepare_config` + `validate_config`.
- deploy/kuberay/*.yaml validate against the KubeRay CRD schemas (ray.io/v1, unknown fields
  rejected) from ../shared/kuberay-crds (or $DUOSPEC_KUBERAY_CRDS); core kinds have their fields.
- Every `duospec ...` command in deploy/ parses with the real CLI parser, and ports, paths, model
  locations and versions agree between serve commands, Service, probes, config and Dockerfile.

What is exposed, and to whom, and what keeps the server running: tests/unit/test_deploy_hardening.py.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import io
import os
import pathlib
import re
import shlex
from urllib.parse import urlsplit

import pytest
import yaml

from deploy_support import (
    API_SERVICE, CLUSTER_CONFIGS, DEPLOY, LEDGER, REPO, TENANTS_SECRET, commands_in, deploy_commands, flag_values,
    head_pod_spec, head_serve_flags, gpus_serve_yaml_places, kuberay_docs, load_yaml, named, readme_commands,
    serve_config, the_doc, yaml_strings,
)

CRD_KINDS = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml",
             "RayService": "ray.io_rayservices.yaml"}
CORE_KINDS = ("Service", "Secret", "ConfigMap", "PersistentVolumeClaim", "NetworkPolicy", "StatefulSet", "Deployment")
API_VERSIONS = {"NetworkPolicy": "networking.k8s.io/v1", "StatefulSet": "apps/v1", "Deployment": "apps/v1"}  # the rest are core v1


# ---------------------------------------------------------------------------------------------
# ray up configs


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_cluster_config_passes_rays_validation(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(load_yaml(DEPLOY / name)))
    validate_config(prepared)
    node_types = prepared["available_node_types"]
    assert prepared["head_node_type"] in node_types
    if prepared["provider"]["type"] == "local":
        # On-prem: Ray detects GPUs at `ray start`; every listed worker joins.
        assert node_types["local.cluster.node"]["min_workers"] == len(prepared["provider"]["worker_ips"]) >= 1
    else:
        # The autoscaler must know it can start every replica's GPUs without being asked, and a node
        # type that holds a whole tensor-parallel group.
        needed, group = gpus_serve_yaml_places()
        min_gpus = sum(t.get("min_workers", 0) * t["resources"].get("GPU", 0) for t in node_types.values())
        assert min_gpus >= needed, f"deploy/{name}: GPU worker min_workers give {min_gpus} GPUs; serve.yaml places {needed}"
        assert max(t["resources"].get("GPU", 0) for t in node_types.values()) >= group, name


def test_cluster_config_typo_is_rejected_by_ray():
    from jsonschema import ValidationError
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load_yaml(DEPLOY / "cluster.yaml")
    config["available_node_types"]["gpu_worker"]["min_worker"] = config["available_node_types"]["gpu_worker"].pop(
        "min_workers")
    with pytest.raises(ValidationError, match="min_worker"):
        validate_config(prepare_config(config))


def test_installed_ray_is_in_the_pinned_range():
    """The validation above is only as good as the Ray it ran with: it must be one users may have."""
    import ray
    from packaging.requirements import Requirement

    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    spec = re.search(r'"(ray\[default\][^"]*)"', pyproject).group(1)
    assert Requirement(spec).specifier.contains(ray.__version__), f"ray {ray.__version__} is outside {spec}"


# ---------------------------------------------------------------------------------------------
# KubeRay manifests against the CRD schemas


def crd_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("DUOSPEC_KUBERAY_CRDS") or REPO.parent / "shared" / "kuberay-crds")


def strict_schema(node):
    """The CRD's OpenAPI schema as JSON Schema that rejects unknown fields, as the API server does:
    `additionalProperties: false` wherever `properties` is given and unknown fields are not kept;
    int-or-string and nullable spelled out for jsonschema."""
    if isinstance(node, list):
        return [strict_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: strict_schema(sub) for name, sub in value.items()}
        else:
            out[key] = strict_schema(value)
    if "properties" in out and "additionalProperties" not in out and not out.get(
            "x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


@pytest.fixture(scope="module")
def crd_validators():
    from jsonschema import Draft7Validator

    root = crd_dir()
    if not root.is_dir():
        pytest.skip(f"KubeRay CRDs not found at {root}; set DUOSPEC_KUBERAY_CRDS to the folder of ray.io_*.yaml")
    validators = {}
    for kind, file_name in CRD_KINDS.items():
        crd = load_yaml(root / file_name)
        assert crd["spec"]["names"]["kind"] == kind, f"{root / file_name}: not the {kind} CRD"
        [v1] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        validators[kind] = Draft7Validator(strict_schema(v1["schema"]["openAPIV3Schema"]))
    return validators


def crd_errors(validators, doc: dict) -> list[str]:
    errors = sorted(validators[doc["kind"]].iter_errors(doc), key=lambda e: list(e.absolute_path))
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]


DNS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def core_kind_errors(doc: dict) -> list[str]:
    """Required fields of the core kinds we ship (what `kubectl apply` would refuse without)."""
    kind, spec = doc["kind"], doc.get("spec") or {}
    api_version = API_VERSIONS.get(kind, "v1")
    errors = [] if doc.get("apiVersion") == api_version else [
        f"apiVersion: {doc.get('apiVersion')!r}, expected {api_version!r}"]
    if kind == "Service":
        ports = spec.get("ports") or []
        if not ports:
            errors.append("spec.ports: missing")
        for i, port in enumerate(ports):
            if not isinstance(port.get("port"), int) or not 0 < port["port"] < 65536:
                errors.append(f"spec.ports[{i}].port: {port.get('port')!r} is not a port number")
            if len(ports) > 1 and not port.get("name"):
                errors.append(f"spec.ports[{i}].name: required when a Service has several ports")
        if not spec.get("selector"):
            errors.append("spec.selector: missing (the Service would select no pod)")
    elif kind == "Deployment":
        errors += workload_errors(spec)
    elif kind in ("Secret", "ConfigMap"):
        data, string_data = doc.get("data") or {}, doc.get("stringData") or {}
        if kind == "ConfigMap" and string_data:
            errors.append("stringData: ConfigMaps have only data/binaryData")
        if not data and not string_data:
            errors.append("data: empty")
        for key, value in {**data, **string_data}.items():
            if not re.fullmatch(r"[-._a-zA-Z0-9]+", key) or not isinstance(value, str):
                errors.append(f"data.{key}: keys are file names, values strings")
        for key, value in (data.items() if kind == "Secret" else ()):
            try:
                base64.b64decode(value, validate=True)
            except ValueError:
                errors.append(f"data.{key}: Secret data must be base64 (or use stringData)")
    elif kind == "NetworkPolicy":
        if not isinstance(spec.get("podSelector"), dict):
            errors.append("spec.podSelector: missing (use {} for every pod)")
        if not set(spec.get("policyTypes") or ()) <= {"Ingress", "Egress"}:
            errors.append(f"spec.policyTypes: {spec.get('policyTypes')!r}; use Ingress and/or Egress")
        for i, rule in enumerate(spec.get("ingress") or []):
            if set(rule) - {"from", "ports"}:
                errors.append(f"spec.ingress[{i}]: unknown keys {sorted(set(rule) - {'from', 'ports'})}")
            for j, port in enumerate(rule.get("ports") or []):
                if not isinstance(port.get("port"), int) or port.get("protocol", "TCP") not in ("TCP", "UDP", "SCTP"):
                    errors.append(f"spec.ingress[{i}].ports[{j}]: {port!r} is not a port rule")
    elif kind == "PersistentVolumeClaim":
        errors += claim_errors(spec, "spec")
    elif kind == "StatefulSet":
        errors += stateful_set_errors(spec)
    return errors


def claim_errors(spec: dict, where: str) -> list[str]:
    errors = [] if spec.get("accessModes") else [f"{where}.accessModes: missing"]
    if not (spec.get("resources") or {}).get("requests", {}).get("storage"):
        errors.append(f"{where}.resources.requests.storage: missing")
    return errors


def stateful_set_errors(spec: dict) -> list[str]:
    """What the API server checks of a StatefulSet, and what would leave it unable to run: its headless
    Service exists, its claims are complete, and what every workload needs (workload_errors)."""
    errors = []
    services = {d["metadata"]["name"] for _, d in kuberay_docs() if d["kind"] == "Service"}
    if spec.get("serviceName") not in services:
        errors.append(f"spec.serviceName: {spec.get('serviceName')!r} names no Service in deploy/kuberay")
    claims = spec.get("volumeClaimTemplates") or []
    for i, claim in enumerate(claims):
        errors += claim_errors(claim.get("spec") or {}, f"spec.volumeClaimTemplates[{i}].spec")
    return errors + workload_errors(spec, {c["metadata"]["name"] for c in claims})


POD_FIELDS = {"containers", "volumes", "securityContext", "terminationGracePeriodSeconds",
              "automountServiceAccountToken", "affinity", "tolerations", "nodeSelector", "serviceAccountName"}
CONTAINER_FIELDS = {"name", "image", "imagePullPolicy", "command", "args", "env", "ports", "readinessProbe",
                    "livenessProbe", "startupProbe", "securityContext", "resources", "volumeMounts"}
# Secrets the operator makes, not shipped here: Ray's token, which must be the RayCluster's (gateway.yaml)
EXTERNAL_SECRETS = {"duospec-ray-token"}


def workload_errors(spec: dict, claims: set[str] = frozenset()) -> list[str]:
    """A Deployment's or StatefulSet's spec: its selector picks its own pods, its pod spec has the fields
    Kubernetes knows (a misspelled one would be dropped by `kubectl apply` without a word), every
    container a name and an image, probes on declared ports, mounts of declared volumes (or `claims`),
    Secrets it reads shipped with the keys it reads."""
    errors = []
    template = spec.get("template") or {}
    labels = (template.get("metadata") or {}).get("labels") or {}
    selector = (spec.get("selector") or {}).get("matchLabels") or {}
    if not selector or selector.items() - labels.items():
        errors.append(f"spec.selector.matchLabels {selector} must be among the template's labels {labels}")
    pod = template.get("spec") or {}
    errors += [f"spec.template.spec.{k}: not a pod field" for k in sorted(set(pod) - POD_FIELDS)]
    volumes = {v.get("name") for v in pod.get("volumes") or []} | set(claims)
    secrets = {d["metadata"]["name"]: d.get("stringData") or d.get("data") or {}
               for _, d in kuberay_docs() if d["kind"] == "Secret"}
    for c in pod.get("containers") or [{}]:
        where = f"spec.template.spec.containers[{c.get('name')!r}]"
        errors += [f"{where}.{k}: not a container field" for k in sorted(set(c) - CONTAINER_FIELDS)]
        if not c.get("image") or not c.get("name"):
            errors.append(f"{where}: name and image are required")
        ports = {p.get("containerPort") for p in c.get("ports") or []}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            port = ((c.get(probe) or {}).get("grpc") or {}).get("port")
            if port is not None and port not in ports:
                errors.append(f"{where}.{probe}: port {port} is not one of the container's ports {sorted(ports)}")
        errors += [f"{where}.volumeMounts: {m.get('name')!r} is no volume of the pod"
                   for m in c.get("volumeMounts") or [] if m.get("name") not in volumes]
        for env in c.get("env") or []:
            ref = (env.get("valueFrom") or {}).get("secretKeyRef")
            if ref and ref["name"] not in EXTERNAL_SECRETS and ref["key"] not in secrets.get(ref["name"], {}):
                errors.append(f"{where}.env.{env['name']}: no Secret {ref['name']!r} with key {ref['key']!r}")
    return errors


def test_every_kuberay_manifest_is_valid(crd_validators):
    docs = kuberay_docs()
    assert {d["kind"] for _, d in docs} >= {"RayCluster", "Service", "Secret", "ConfigMap"}
    for file_name, doc in docs:
        where = f"deploy/kuberay/{file_name} ({doc.get('kind')} {doc.get('metadata', {}).get('name')})"
        name = (doc.get("metadata") or {}).get("name", "")
        assert DNS_NAME.match(name), f"{where}: metadata.name {name!r} is not a DNS-1123 name"
        if doc.get("kind") in CRD_KINDS:
            assert doc.get("apiVersion") == "ray.io/v1", f"{where}: use apiVersion ray.io/v1"
            errors = crd_errors(crd_validators, doc)
        elif doc.get("kind") in CORE_KINDS:
            errors = core_kind_errors(doc)
        else:
            errors = [f"kind {doc.get('kind')!r} has no check here; add one to tests/unit/test_deploy.py"]
        assert not errors, f"{where}:\n  " + "\n  ".join(errors)


@pytest.mark.parametrize("path, typo", [
    (("spec", "headGroupSpec", "rayStartParams"), "rayStartParam"),
    (("spec", "headGroupSpec", "template", "spec", "containers", 0, "readinessProbe", "grpc", "port"), "prot"),
    (("spec", "workerGroupSpecs", 0, "template", "spec", "containers", 0, "resources"), "resource"),
])
def test_misspelled_field_is_rejected(crd_validators, path, typo):
    doc = copy.deepcopy(the_doc("RayCluster"))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[typo] = parent.pop(path[-1])
    errors = crd_errors(crd_validators, doc)
    assert any(repr(typo) in e and "not allowed" in e for e in errors), errors


def test_int_or_string_quantities_accept_both_and_nothing_else(crd_validators):
    doc = copy.deepcopy(the_doc("RayCluster"))
    limits = doc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]
    limits["nvidia.com/gpu"] = "1"
    assert crd_errors(crd_validators, doc) == []
    limits["nvidia.com/gpu"] = [1]
    assert any("nvidia.com/gpu" in e for e in crd_errors(crd_validators, doc))


# ---------------------------------------------------------------------------------------------
# Commands in the deploy files parse with the real CLI


def test_every_documented_duospec_command_parses():
    from duospec.cli import build_parser

    commands = deploy_commands() + readme_commands()
    serve = [argv for _, argv in commands if argv[0] == "serve"]
    assert len(serve) >= 4, f"expected serve commands in cluster*.yaml, raycluster.yaml and the README: {commands}"
    parser = build_parser()
    for source, argv in commands:
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.suppress(SystemExit):
            parser.parse_args(argv)
            continue
        pytest.fail(f"{source}: `duospec {shlex.join(argv)}` does not parse: {stderr.getvalue().strip()}")


def test_serve_commands_match_the_config_ports_and_address():
    server = serve_config()["server"]
    for source, argv in deploy_commands():
        if argv[0] != "serve":
            continue
        flags = flag_values(argv[1:])
        where = f"{source}: `duospec {shlex.join(argv)}`"
        assert flags.get("--port") == str(server["port"]), f"{where}: --port differs from serve.yaml"
        assert flags.get("--metrics-port") == str(server["metrics_port"]), f"{where}: --metrics-port differs"
        assert flags.get("--http-port") == str(server["http_port"]), f"{where}: --http-port differs"
        assert flags.get("--host") == server["host"] == "0.0.0.0", f"{where}: must listen on 0.0.0.0"
        assert flags.get("--address") == "auto", f"{where}: the server joins the cluster it runs on"
        # Bound beyond loopback the server requires a tenants file (DESIGN.md section 7).
        assert flags.get("--tenants"), f"{where}: --tenants missing"
        assert flags.get("--config", "").endswith("serve.yaml"), f"{where}: --config is not the serve.yaml"


def test_ray_up_serves_the_synced_config_and_mounted_tenants():
    for name in CLUSTER_CONFIGS:
        config = load_yaml(DEPLOY / name)
        [argv] = [a for text in config["head_start_ray_commands"] for a in commands_in(text) if a[0] == "serve"]
        flags = flag_values(argv[1:])
        # file_mounts: remote path -> local path (relative to the repo root, where `ray up` runs).
        src_remote = next(r for r, local in config["file_mounts"].items() if local == ".")
        assert flags["--config"] == f"{src_remote}/deploy/serve.yaml", name
        assert flags["--tenants"] in config["file_mounts"], f"{name}: --tenants is not a file_mounts target"
        assert f"{src_remote}/deploy/wait_for_gpus.py" in " ".join(config["head_start_ray_commands"]), name


def test_wait_for_gpus_invocations_parse():
    import importlib.util

    spec = importlib.util.spec_from_file_location("wait_for_gpus", DEPLOY / "wait_for_gpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in CLUSTER_CONFIGS:
        text = " ".join(load_yaml(DEPLOY / name)["head_start_ray_commands"])
        args = re.search(r"wait_for_gpus\.py((?: --[\w-]+ \S+)*)", text).group(1).split()
        parsed = module.build_parser().parse_args(args)
        assert parsed.gpus == gpus_serve_yaml_places()[0] and parsed.address == "auto", name


# ---------------------------------------------------------------------------------------------
# KubeRay: ports, probes, mounts and config agree


def test_kuberay_ports_agree_between_server_service_and_probe():
    server = serve_config()["server"]
    grpc_port, http_port, metrics_port = server["port"], server["http_port"], server["metrics_port"]
    container = head_pod_spec()["containers"][0]
    flags = head_serve_flags()
    assert (flags["--port"], flags["--http-port"], flags["--metrics-port"]) == \
        (str(grpc_port), str(http_port), str(metrics_port))
    assert container["readinessProbe"]["grpc"]["port"] == grpc_port
    container_ports = {p["containerPort"] for p in container["ports"]}
    assert {grpc_port, http_port, metrics_port} <= container_ports
    service = named("Service", API_SERVICE)
    targets = {p["targetPort"] for p in service["spec"]["ports"]}
    assert targets == {grpc_port, http_port, metrics_port}, f"Service targetPorts {targets}"
    head_labels = {"ray.io/cluster": the_doc("RayCluster")["metadata"]["name"], "ray.io/node-type": "head"}
    assert service["spec"]["selector"] == head_labels


def volume_mount_for(pod_spec: dict, predicate) -> str:
    [volume] = [v for v in pod_spec["volumes"] if predicate(v)]
    [mount] = [m for m in pod_spec["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    return mount["mountPath"]


def test_kuberay_head_mounts_the_configmap_and_secret_and_reaches_the_ledger_database():
    pod = head_pod_spec()
    flags = head_serve_flags()
    configmap, secret = the_doc("ConfigMap"), named("Secret", TENANTS_SECRET)
    config_dir = volume_mount_for(pod, lambda v: v.get("configMap", {}).get("name") == configmap["metadata"]["name"])
    tenants_dir = volume_mount_for(pod, lambda v: v.get("secret", {}).get("secretName") == secret["metadata"]["name"])
    config_path, tenants_path = pathlib.PurePosixPath(flags["--config"]), pathlib.PurePosixPath(flags["--tenants"])
    assert str(config_path.parent) == config_dir and config_path.name in configmap["data"]
    assert str(tenants_path.parent) == tenants_dir and tenants_path.name in secret["stringData"]
    grace = serve_config()["server"]["grace_period_s"]
    assert pod["terminationGracePeriodSeconds"] > grace, "pods must outlive the server's drain period"


def test_the_head_writes_its_ledger_to_the_shipped_postgres_with_the_secrets_password():
    """--ledger names the database's Service, port, user and database, and no password; the head's
    PGPASSWORD and the database's POSTGRES_PASSWORD are the same Secret key."""
    url = urlsplit(head_serve_flags()["--ledger"])
    service, database = named("Service", LEDGER), named("StatefulSet", LEDGER)
    [container] = database["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert url.scheme == "postgresql" and url.password is None, "the password comes from PGPASSWORD, not the URL"
    assert (url.hostname, url.port) == (service["metadata"]["name"], service["spec"]["ports"][0]["port"])
    assert (url.username, url.path.lstrip("/")) == (env["POSTGRES_USER"]["value"], env["POSTGRES_DB"]["value"])
    assert service["spec"]["selector"].items() <= database["spec"]["template"]["metadata"]["labels"].items()
    head_env = {e["name"]: e for e in head_pod_spec()["containers"][0]["env"]}
    password = env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert head_env["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == password
    assert password["key"] in named("Secret", password["name"])["stringData"]


def test_configmap_carries_deploy_serve_yaml():
    [(key, text)] = the_doc("ConfigMap")["data"].items()
    assert yaml.safe_load(text) == serve_config(), (
        "deploy/kuberay/serve-config.yaml differs from deploy/serve.yaml; copy one into the other")


def test_serve_config_and_tenants_load_with_the_real_loaders():
    from duospec.coordinator.config import load_serve_config
    from duospec.coordinator.tenants.tenancy import parse_tenants

    config = load_serve_config(DEPLOY / "serve.yaml")
    assert config.models and all(m.draft for m in config.models), "the deployment serves draft/target pairs"
    [(key, text)] = named("Secret", TENANTS_SECRET)["stringData"].items()
    tenants = parse_tenants(yaml.safe_load(text), source=f"tenants-secret.yaml:{key}")
    assert tenants, "the shipped tenants file should show at least one tenant"


# ---------------------------------------------------------------------------------------------
# Image: models, versions, ports


def dockerfile() -> str:
    return (REPO / "Dockerfile").read_text(encoding="utf-8")


def image_models_dir() -> str:
    [dest] = re.findall(r"^COPY\s+(?:--\S+\s+)*models/?\s+(\S+)\s*$", dockerfile(), flags=re.M)
    return dest.rstrip("/")


def test_model_paths_are_where_the_image_and_ray_up_put_the_models():
    models_dir = image_models_dir()
    for model in serve_config()["models"]:
        for role in ("target", "draft"):
            assert model[role].startswith(models_dir + "/"), f"serve.yaml {model['name']}.{role} is outside {models_dir}"
    for name in CLUSTER_CONFIGS:
        setup = " ".join(load_yaml(DEPLOY / name)["setup_commands"])
        assert re.search(rf"ln -sfn \S+/models {re.escape(models_dir)}(\s|$)", setup), (
            f"deploy/{name}: setup_commands do not link the repo's models to {models_dir}")


def test_bundled_models_exist_for_the_configured_paths():
    if not any((REPO / "models").glob("*/config.json")):
        pytest.skip("models/ holds no checkpoint yet (bundled pair not trained into the repo)")
    models_dir = image_models_dir()
    for model in serve_config()["models"]:
        for role in ("target", "draft"):
            relative = pathlib.PurePosixPath(model[role]).relative_to(models_dir)
            assert (REPO / "models" / relative / "config.json").is_file(), f"models/{relative} is missing"


def test_ray_versions_agree_across_image_cluster_and_raycluster():
    base = re.search(r"^ARG RAY_IMAGE=rayproject/ray:([\d.]+)-py311-gpu$", dockerfile(), flags=re.M)
    assert base, "Dockerfile: base image must be rayproject/ray:<version>-py311-gpu"
    cluster_image = load_yaml(DEPLOY / "cluster.yaml")["docker"]["image"]
    assert cluster_image == f"rayproject/ray:{base.group(1)}-py311-gpu"
    assert the_doc("RayCluster")["spec"]["rayVersion"] == base.group(1)


def test_kuberay_pods_run_the_image_the_readme_builds():
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), flags=re.M).group(1)
    image = f"duospec:{version}"
    assert f"docker build -t {image} ." in (DEPLOY / "README.md").read_text(encoding="utf-8")
    spec = the_doc("RayCluster")["spec"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    assert {c["image"] for g in groups for c in g["template"]["spec"]["containers"]} == {image}
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", dockerfile(), flags=re.M) for p in line.split()}
    server = serve_config()["server"]
    assert exposed == {server["port"], server["http_port"], server["metrics_port"]}


def test_gpu_workers_hold_what_the_serve_config_places():
    """Every replica's GPUs, each tensor-parallel group's on one pod; checked with duospec's own placement."""
    from duospec.cluster.placement import plan_placement
    from duospec.coordinator.config import load_serve_config

    nodes, total = [], 0
    for group in the_doc("RayCluster")["spec"]["workerGroupSpecs"]:
        resources = group["template"]["spec"]["containers"][0]["resources"]
        gpus = int(resources["limits"]["nvidia.com/gpu"])
        assert str(resources["requests"]["nvidia.com/gpu"]) == str(gpus)
        nodes += [{"Alive": True, "Resources": {"CPU": 16.0, "GPU": float(gpus)}}] * group["replicas"]
        total += gpus * group["replicas"]
    assert total >= gpus_serve_yaml_places()[0]
    for m in load_serve_config(DEPLOY / "serve.yaml").models:  # a group no pod holds is refused here
        plan_placement(nodes, use_gpu=True, target_tp=m.tensor_parallel_size, draft_tp=m.draft.tensor_parallel_size)


def test_kuberay_gateways_join_the_deployment_on_the_configs_ports_behind_their_service():
    server = serve_config()["server"]
    deployment = named("Deployment", "duospec-gateway")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    [argv] = [a for text in yaml_strings(container) for a in commands_in(text) if a[0] == "serve"]
    flags = flag_values(argv[1:])
    assert "--gateway-only" in argv and flags["--address"] == "auto"  # the node `ray start` joined
    assert (flags["--port"], flags["--http-port"], flags["--metrics-port"]) == \
        (str(server["port"]), str(server["http_port"]), str(server["metrics_port"]))
    assert flags["--config"].startswith(volume_mount_for(pod, lambda v: "configMap" in v))
    assert flags["--tenants"].startswith(volume_mount_for(pod, lambda v: "secret" in v))
    service = named("Service", "duospec-gateway")
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {p["containerPort"] for p in container["ports"]}
    # it joins Ray with the cluster's token mode, so Ray admits it
    env = {e["name"]: e for e in container["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token" and "secretKeyRef" in env["RAY_AUTH_TOKEN"]["valueFrom"]
