"""What the deployment exposes, to whom, and what keeps the server running.

- Ray's token authentication is on in every shipped config: `ray up`'s start commands run here (one
  shell each, as `ray up` runs them) with a fake `ray` and `setsid` that record their environment,
  and every `ray start` and the server's launch see RAY_AUTH_MODE=token, the token being synced to
  every node; the RayCluster sets authOptions.mode token.
- Ray's dashboard listens on loopback under `ray up`; on KubeRay the NetworkPolicies admit only the
  RayCluster's own pods to it, and only the monitoring namespace to the metrics.
- duospec's metrics listen on loopback unless a deploy file names an address (KubeRay: the pod IP).
- KubeRay pods: no privilege escalation, no capabilities, no service-account token.
- deploy/supervise.py, launched as `ray up` launches it, restarts a command that exits or is killed
  (with growing delays) and stops it on request.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest
import yaml

from deploy_support import (
    API_SERVICE, CLUSTER_CONFIGS, DEPLOY, LEDGER, REPO, commands_in, deploy_commands, flag_values, head_pod_spec,
    head_serve_flags, kuberay_docs, load_yaml, named, readme_commands, the_doc,
)

SUPERVISE = DEPLOY / "supervise.py"
POD_IP = "10.4.2.7"
MONITORING = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------
# ray up: token authentication, the dashboard, the server's launch


def recording_tool(path: pathlib.Path, record: pathlib.Path) -> None:
    """A stand-in for `ray` / `setsid`: appends its argv and RAY_AUTH_MODE to `record`, does nothing else."""
    path.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"with open({str(record)!r}, 'a') as f:\n"
                    f"    f.write(json.dumps({{'tool': {path.name!r}, 'argv': sys.argv[1:], "
                    "'auth_mode': os.environ.get('RAY_AUTH_MODE')}) + '\\n')\n")
    path.chmod(0o755)


def run_ray_up_commands(commands: list[str], root: pathlib.Path, expect_setsid: bool,
                        node_env: dict[str, str] | None = None) -> list[dict]:
    """Runs `commands` as `ray up` does (one shell each, in order) in a fresh home with the repo at
    ~/duospec-src and fake `ray`/`setsid` on PATH and in ~/duospec-venv/bin, with `node_env` (what a node
    type's docker run options set); returns their records."""
    home, tools, record = root / "home", root / "bin", root / "calls.jsonl"
    venv_tools = home / "duospec-venv" / "bin"  # cluster.local.yaml names its venv's tools
    for folder in (tools, venv_tools):
        folder.mkdir(parents=True)
        recording_tool(folder / "ray", record)
        (folder / "python").symlink_to(sys.executable)
    recording_tool(tools / "setsid", record)
    (home / "duospec-src").symlink_to(REPO)
    env = {"HOME": str(home), "PATH": f"{tools}:/usr/bin:/bin", "RAY_HEAD_IP": "10.0.0.1", **(node_env or {})}
    for command in commands:
        done = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"`{command}` failed: {done.stderr}"
    # The server's launch ends in `&`: its record may land after the shell has returned.
    deadline = time.monotonic() + 30
    while expect_setsid and '"setsid"' not in (record.read_text() if record.exists() else ""):
        assert time.monotonic() < deadline, "the head's commands never launched the server (no setsid)"
        time.sleep(0.02)
    return [json.loads(line) for line in record.read_text().splitlines()]


def load_supervise():
    spec = importlib.util.spec_from_file_location("supervise", SUPERVISE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_ray_up_starts_every_node_with_token_auth_and_the_dashboard_on_loopback(name, tmp_path):
    config = load_yaml(DEPLOY / name)
    head = run_ray_up_commands(config["head_start_ray_commands"], tmp_path / "head", expect_setsid=True)
    workers = run_ray_up_commands(config["worker_start_ray_commands"], tmp_path / "worker", expect_setsid=False)
    starts = [c for c in head + workers if c["tool"] == "ray" and c["argv"][:1] == ["start"]]
    assert len(starts) == 2, starts
    for call in starts:
        assert call["auth_mode"] == "token", \
            f"deploy/{name}: `ray {shlex.join(call['argv'])}` runs without RAY_AUTH_MODE=token"
    [head_start] = [c for c in starts if "--head" in c["argv"]]
    dashboard = flag_values(head_start["argv"]).get("--dashboard-host", "127.0.0.1")  # Ray's default: loopback
    assert is_loopback(dashboard), f"deploy/{name}: Ray's dashboard (job submission runs code) on {dashboard}"
    # The token sits at Ray's default path on every node (file_mounts reach workers too).
    assert config["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token", name
    [launch] = [c for c in head if c["tool"] == "setsid"]
    assert launch["auth_mode"] == "token", f"deploy/{name}: duospec serve joins Ray without the token mode"


def test_ray_up_gateway_nodes_run_a_supervised_gateway_and_gpu_nodes_none(tmp_path):
    config = load_yaml(DEPLOY / "cluster.yaml")
    node = config["available_node_types"]["gateway"]
    env = dict(option.split(" ", 1)[1].split("=", 1) for option in node["docker"]["worker_run_options"]
               if option.startswith("--env "))
    calls = run_ray_up_commands(config["worker_start_ray_commands"], tmp_path / "gw", expect_setsid=True,
                                node_env=env)
    [launch] = [c for c in calls if c["tool"] == "setsid"]
    assert launch["auth_mode"] == "token"
    nohup, python, script, *args = launch["argv"]
    parsed = load_supervise().build_parser().parse_args(args)
    serve = parsed.command[1:]
    assert serve[:3] == ["duospec", "serve", "--gateway-only"] and flag_values(serve)["--address"] == "auto"
    gpu = run_ray_up_commands(config["worker_start_ray_commands"], tmp_path / "gpu", expect_setsid=False)
    assert not [c for c in gpu if c["tool"] == "setsid"]  # a GPU worker runs no gateway


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_ray_up_runs_the_server_under_the_supervisor(name, tmp_path):
    """Launched with setsid + nohup (it outlives `ray up`'s shell), a supervisor that keeps `bash -c
    "wait_for_gpus.py && exec duospec serve"` running; the previous one is stopped before `ray stop`."""
    commands = load_yaml(DEPLOY / name)["head_start_ray_commands"]
    [launch] = [c for c in run_ray_up_commands(commands, tmp_path, expect_setsid=True) if c["tool"] == "setsid"]
    nohup, python, script, *args = launch["argv"]
    assert nohup == "nohup" and pathlib.Path(script).resolve() == SUPERVISE.resolve(), launch["argv"]
    parsed = load_supervise().build_parser().parse_args(args)
    assert parsed.command[:3] == ["--", "bash", "-c"] and parsed.log, parsed
    [serve] = [argv for argv in commands_in(parsed.command[3]) if argv[0] == "serve"]
    assert "wait_for_gpus.py" in parsed.command[3] and serve
    [stop_at] = [i for i, c in enumerate(commands) if "supervise.py --stop" in c]
    [ray_stop_at] = [i for i, c in enumerate(commands) if re.fullmatch(r"(\S*/)?ray stop", c)]
    assert stop_at < ray_stop_at, f"deploy/{name}: stop the supervisor before Ray, or it restarts serve against no Ray"
    stop_pidfile = re.search(r"supervise\.py --stop --pidfile (\S+)", commands[stop_at]).group(1)
    assert str(parsed.pidfile) == stop_pidfile.replace("~", str(tmp_path / "home"), 1)
    assert not any("tmux" in c for c in commands), f"deploy/{name}: tmux is no supervisor"


def test_no_deploy_file_sets_rays_auth_mode_to_anything_but_token():
    paths = [*sorted(DEPLOY.rglob("*.yaml")), DEPLOY / "README.md", REPO / "Dockerfile"]
    found = 0
    for path in paths:
        for value in re.findall(r"RAY_AUTH_MODE[\"']?\s*[=:]\s*[\"']?([\w-]*)", path.read_text(encoding="utf-8")):
            assert value == "token", f"{path.relative_to(REPO)}: RAY_AUTH_MODE={value}"
            found += 1
    assert found >= 4, "every ray start under ray up names RAY_AUTH_MODE=token"
    spec = the_doc("RayCluster")["spec"]
    assert spec.get("authOptions", {}).get("mode") == "token", "raycluster.yaml: set authOptions: {mode: token}"
    for group, pod in pod_specs():
        for container in pod["containers"]:
            for var in container.get("env", []):
                assert var["name"] != "RAY_AUTH_MODE" or var.get("value") == "token", f"{group}: {var}"


# ---------------------------------------------------------------------------------------------
# duospec's metrics


def test_metrics_listen_on_loopback_unless_a_deploy_file_names_an_address(monkeypatch):
    from duospec.cli import build_parser
    from duospec.cli import serve as serve_cli
    from duospec.coordinator.config import ModelConfig, ServerSettings, parse_serve_config

    assert is_loopback(ServerSettings().metrics_host)
    assert is_loopback(ServerSettings(host="0.0.0.0").metrics_host), "a wide API does not widen the metrics"
    # Every serve config shipped (deploy/serve.yaml, the examples, the KubeRay ConfigMap's copy), not
    # only the one the deployments mount: a user may serve any of them as it is.
    configs = [(str(path.relative_to(REPO)), doc) for path in sorted(DEPLOY.rglob("*.yaml"))
               for doc in yaml.safe_load_all(path.read_text(encoding="utf-8"))]
    configs += [(f"ConfigMap {key}", yaml.safe_load(text)) for key, text in the_doc("ConfigMap")["data"].items()]
    served = [(source, raw) for source, raw in configs if isinstance(raw, dict) and "models" in raw]
    assert {"deploy/serve.yaml", "deploy/examples/smollm2.yaml"} <= {source for source, _ in served}, served
    for source, raw in served:
        host = parse_serve_config(raw, source=source).server.metrics_host
        assert is_loopback(host), f"{source}: server.metrics_host {host!r} serves metrics beyond loopback"
    # Every command names its model through --config; the README's plain `docker run` uses the bundled one.
    monkeypatch.setattr(serve_cli, "default_model", lambda _dir: ModelConfig(name="m", target="/m"))
    parser = build_parser()
    serves = [(source, argv) for source, argv in deploy_commands() + readme_commands() if argv[0] == "serve"]
    assert len(serves) >= 4, serves
    for source, argv in serves:
        args = parser.parse_args(argv)
        if args.config is not None:
            args.config = DEPLOY / "serve.yaml"  # what every deployment mounts at its --config path
        host = serve_cli.build_config(args).server.metrics_host
        pod_ip = source in ("deploy/kuberay/raycluster.yaml", "deploy/kuberay/gateway.yaml") \
            and host == "${POD_IP:?}"  # checked below
        assert is_loopback(host) or pod_ip, f"{source}: `duospec {shlex.join(argv)}` serves metrics on {host!r}"


def test_an_empty_metrics_address_is_refused_not_read_as_every_interface(tmp_path, capsys):
    from duospec.cli import build_parser
    from duospec.coordinator.config import ConfigError, load_serve_config

    config = tmp_path / "serve.yaml"
    config.write_text("server: {metrics_host: ''}\nmodels: [{name: m, target: /m}]\n")
    with pytest.raises(ConfigError, match="server.metrics_host: empty"):
        load_serve_config(config)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--metrics-host", " "])
    assert "--metrics-host: empty" in capsys.readouterr().err


def test_kuberay_head_starts_ray_without_block_then_execs_serve_with_metrics_on_the_pod_ip(tmp_path):
    """The head container's shell: KubeRay's generated `ray start` minus --block (quoted JSON
    intact), then `duospec serve` as the main process, metrics on the downward API's pod IP; without
    a pod IP it refuses to start rather than listen everywhere. Fake `ray`/`duospec` record their argv."""
    for tool in ("ray", "duospec"):
        fake = tmp_path / tool
        fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{tmp_path}/{tool}.argv"\n')
        fake.chmod(0o755)
    container = head_pod_spec()["containers"][0]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
    generated = """ray start --head --resources='{"duospec": 1}' --block --num-gpus=0"""
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "KUBERAY_GEN_RAY_START_CMD": generated}
    # Without -l: this machine's login profile would reset PATH and hide the fakes.
    command = [arg.replace("-lc", "-c") for arg in container["command"]]
    refused = subprocess.run([*command, *container["args"]], env=env, capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0 and "POD_IP" in refused.stderr and not (tmp_path / "duospec.argv").exists()
    done = subprocess.run([*command, *container["args"]], env={**env, "POD_IP": POD_IP}, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    ray_argv = (tmp_path / "ray.argv").read_text().splitlines()
    assert ray_argv == ["start", "--head", '--resources={"duospec": 1}', "--num-gpus=0"]
    serve_argv = (tmp_path / "duospec.argv").read_text().splitlines()
    assert serve_argv[0] == "serve" and flag_values(serve_argv[1:]) == {**head_serve_flags(), "--metrics-host": POD_IP}


# ---------------------------------------------------------------------------------------------
# KubeRay: who reaches what, and with which privileges


def pod_specs() -> list[tuple[str, dict]]:
    spec = the_doc("RayCluster")["spec"]
    return [("head", spec["headGroupSpec"]["template"]["spec"]),
            *[(group["groupName"], group["template"]["spec"]) for group in spec["workerGroupSpecs"]],
            *[(d["metadata"]["name"], d["spec"]["template"]["spec"]) for _, d in kuberay_docs()
              if d["kind"] in ("StatefulSet", "Deployment")]]


GATEWAY_LABELS = {"app.kubernetes.io/name": "duospec", "app.kubernetes.io/component": "gateway"}  # gateway.yaml


def test_kuberay_exposes_only_the_api_and_metrics_beyond_the_raycluster():
    """The dashboard (job submission runs code), GCS and the workers' data-plane ports are reachable
    only from the RayCluster's own pods and the gateways that join it; from elsewhere only gRPC 50051
    and HTTP 8000 on the head and the gateways, and their metrics 9400 only from the monitoring namespace."""
    cluster = the_doc("RayCluster")["metadata"]["name"]
    database = named("StatefulSet", LEDGER)["spec"]["template"]["metadata"]["labels"]
    policies = [d for _, d in kuberay_docs() if d.get("kind") == "NetworkPolicy"
                and d["spec"]["podSelector"]["matchLabels"] != database]
    own_pods = {"podSelector": {"matchLabels": {"ray.io/cluster": cluster}}}
    gateways = {"podSelector": {"matchLabels": GATEWAY_LABELS}}
    opened_to_outside: dict[str, set] = {}
    for policy in policies:
        spec = policy["spec"]
        assert "Ingress" in spec["policyTypes"]
        selected = spec["podSelector"]["matchLabels"]
        assert selected.get("ray.io/cluster") == cluster or selected == GATEWAY_LABELS, policy["metadata"]["name"]
        for rule in spec.get("ingress", []):
            if rule.get("from") == [own_pods, gateways]:
                continue  # the pods of this RayCluster and the gateways that join it talk to each other freely
            assert "from" not in rule or rule["from"], "an empty from would admit everyone"
            ports = {p["port"] for p in rule.get("ports", [])}
            assert ports, f"{policy['metadata']['name']}: a rule open to other pods must name its ports"
            if 9400 in ports:
                assert rule.get("from") == MONITORING and ports == {9400}, \
                    f"{policy['metadata']['name']}: metrics (9400) only to the monitoring namespace: {rule}"
            kind = "gateway" if selected == GATEWAY_LABELS else selected.get("ray.io/node-type", "all")
            opened_to_outside.setdefault(kind, set()).update(ports)
    assert opened_to_outside == {"head": {50051, 8000, 9400}, "gateway": {50051, 8000, 9400}}
    assert any(p["spec"]["podSelector"]["matchLabels"] == {"ray.io/cluster": cluster} for p in policies), \
        "every pod of the RayCluster must be covered by a policy"
    service = named("Service", API_SERVICE)
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP" and {p["port"] for p in service["spec"]["ports"]} \
        == {50051, 8000, 9400}
    head_service = the_doc("RayCluster")["spec"]["headGroupSpec"]["headService"]["spec"]
    assert head_service.get("clusterIP") == "None" and head_service.get("type", "ClusterIP") == "ClusterIP"


def test_only_the_head_and_the_gateways_reach_the_ledger_database_and_only_on_its_port():
    cluster = the_doc("RayCluster")["metadata"]["name"]
    database = named("StatefulSet", LEDGER)["spec"]["template"]["metadata"]["labels"]
    [policy] = [d for _, d in kuberay_docs() if d.get("kind") == "NetworkPolicy"
                and d["spec"]["podSelector"]["matchLabels"] == database]
    head = {"podSelector": {"matchLabels": {"ray.io/cluster": cluster, "ray.io/node-type": "head"}}}
    gateways = {"podSelector": {"matchLabels": GATEWAY_LABELS}}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"from": [head, gateways], "ports": [{"port": 5432, "protocol": "TCP"}]}]
    assert named("Service", LEDGER)["spec"].get("type", "ClusterIP") == "ClusterIP"


def test_kuberay_pods_run_unprivileged_without_a_service_account_token():
    for group, pod in pod_specs():
        assert pod.get("automountServiceAccountToken") is False, f"{group}: automountServiceAccountToken: false"
        assert not (pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC")), group
        for container in [*pod["containers"], *pod.get("initContainers", [])]:
            where = f"{group}/{container['name']}"
            context = container.get("securityContext") or {}
            assert context.get("allowPrivilegeEscalation") is False, f"{where}: allowPrivilegeEscalation: false"
            assert not context.get("privileged"), where
            capabilities = context.get("capabilities") or {}
            assert capabilities.get("drop") == ["ALL"] and not capabilities.get("add"), f"{where}: {capabilities}"


# ---------------------------------------------------------------------------------------------
# deploy/supervise.py, run for real


def launch_supervisor(tmp_path: pathlib.Path, *command: str, **options) -> int:
    """Starts the supervisor as the ray up configs do (setsid nohup ... &, from a shell that then
    exits) and returns its pid once its pidfile names it."""
    args = [sys.executable, str(SUPERVISE), "--pidfile", str(tmp_path / "pid"), "--log", str(tmp_path / "log")]
    for name, value in {"min_backoff": 0.05, "max_backoff": 0.2, **options}.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    line = shlex.join([*args, "--", *command])
    subprocess.run(["bash", "-c", f"setsid nohup {line} > /dev/null 2>&1 < /dev/null &"], check=True, timeout=30)
    return wait_for(lambda: load_supervise().running_supervisor(tmp_path / "pid"), "the supervisor's pidfile")


def stop_supervisor(tmp_path: pathlib.Path, pid: int) -> None:
    done = subprocess.run([sys.executable, str(SUPERVISE), "--stop", "--pidfile", str(tmp_path / "pid")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and f"stopped pid {pid}" in done.stderr, done.stderr
    assert gone_or_zombie(pid) and not (tmp_path / "pid").exists()


def gone_or_zombie(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"  # exited; its new parent has not reaped it yet


def wait_for(probe, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (value := probe()):
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:g} s"
        time.sleep(0.02)
    return value


def lines(path: pathlib.Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_supervisor_restarts_a_crashing_command_with_growing_delays(tmp_path):
    runs = tmp_path / "runs"
    pid = launch_supervisor(tmp_path, "sh", "-c", f"echo run >> {shlex.quote(str(runs))}; exit 3")
    try:
        wait_for(lambda: len(lines(runs)) >= 5, "fifth start of the crashing command")
    finally:
        stop_supervisor(tmp_path, pid)
    log = (tmp_path / "log").read_text()
    delays = re.findall(r"exited with status 3 after [\d.]+ s; restarting in ([\d.]+) s", log)
    assert [float(d) for d in delays[:4]] == [0.05, 0.1, 0.2, 0.2], log  # doubled, capped at --max-backoff
    assert log.splitlines()[-1].endswith("SIGTERM received: not restarting"), log


SERVER = """
import os, pathlib, signal, sys, time
events = pathlib.Path(sys.argv[1])
def drain(signum, frame):
    with events.open("a") as f:
        f.write(f"drained {os.getpid()}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, drain)
with events.open("a") as f:
    f.write(f"serving {os.getpid()}\\n")
while True:
    time.sleep(1)
"""


def test_supervisor_restarts_a_killed_server_and_lets_it_drain_on_stop(tmp_path):
    events = tmp_path / "events"

    def serving() -> list[int]:
        return [int(line.split()[1]) for line in lines(events) if line.startswith("serving")]

    pid = launch_supervisor(tmp_path, sys.executable, "-c", SERVER, str(events))
    try:
        [first] = wait_for(serving, "first start")
        os.kill(first, signal.SIGKILL)  # a crash: no cleanup, no exit status of its own
        first_again, second = wait_for(lambda: len(serving()) == 2 and serving(), "restart after the kill")
    finally:
        stop_supervisor(tmp_path, pid)
    assert first_again == first != second
    assert f"drained {second}" in lines(events)  # the supervisor's SIGTERM reached the server
    assert gone_or_zombie(second)
    assert re.search(rf"pid {first} killed by SIGKILL after [\d.]+ s; restarting in 0.05 s", (tmp_path / "log").read_text())


def test_supervisor_kills_a_command_that_ignores_sigterm_and_refuses_a_second_supervisor(tmp_path):
    up = tmp_path / "up"
    stubborn = (f"import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                f"pathlib.Path({str(up)!r}).write_text('up'); time.sleep(600)")
    pid = launch_supervisor(tmp_path, sys.executable, "-c", stubborn, stop_timeout=0.5)
    try:
        wait_for(up.exists, "the stubborn command")
        second = subprocess.run([sys.executable, str(SUPERVISE), "--pidfile", str(tmp_path / "pid"), "--log",
                                 str(tmp_path / "log2"), "--", "true"], capture_output=True, text=True, timeout=30)
        assert second.returncode == 1 and f"pid {pid} already supervises" in second.stderr
    finally:
        stop_supervisor(tmp_path, pid)
    log = (tmp_path / "log").read_text()
    assert "still running 0.5 s after SIGTERM; killing its process group" in log
    assert "killed by SIGKILL" in log.splitlines()[-1] and "not restarting" in log.splitlines()[-1]
