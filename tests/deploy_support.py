"""Shared pieces for the deployment tests (this module holds no tests of its own): the files in
deploy/ as data, and the `duospec ...` commands they run, as argv."""

from __future__ import annotations

import pathlib
import re
import shlex

import yaml

REPO = pathlib.Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
KUBERAY = DEPLOY / "kuberay"
CLUSTER_CONFIGS = ("cluster.yaml", "cluster.local.yaml")


def load_yaml(path: pathlib.Path):
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def kuberay_docs() -> list[tuple[str, dict]]:
    """(file name, manifest) for every document in deploy/kuberay."""
    docs = []
    for path in sorted(KUBERAY.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    return docs


def the_doc(kind: str) -> dict:
    found = [d for _, d in kuberay_docs() if d.get("kind") == kind]
    assert len(found) == 1, f"deploy/kuberay: expected exactly one {kind}, found {len(found)}"
    return found[0]


def named(kind: str, name: str) -> dict:
    found = [d for _, d in kuberay_docs() if d.get("kind") == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"deploy/kuberay: expected exactly one {kind} {name!r}, found {len(found)}"
    return found[0]


API_SERVICE = "duospec"  # the Service in front of the head's APIs
TENANTS_SECRET = "duospec-tenants"
LEDGER = "duospec-ledger"  # the ledger database's Service, StatefulSet and password Secret


def serve_config() -> dict:
    return load_yaml(DEPLOY / "serve.yaml")


def gpus_serve_yaml_places() -> tuple[int, int]:
    """(GPUs every replica of every model takes, the most one tensor-parallel group needs on one node)
    of deploy/serve.yaml, read by the real loader."""
    from duospec.coordinator.config import load_serve_config

    total, group = 0, 1
    for m in load_serve_config(DEPLOY / "serve.yaml").models:
        draft = m.draft.tensor_parallel_size if m.draft is not None and m.draft.method.needs_model else 0
        total += m.replicas * (m.tensor_parallel_size + draft)
        group = max(group, m.tensor_parallel_size, draft)
    return total, group


SHELL_OPERATOR = re.compile(r"^[();<>|&]+$")
SUBCOMMAND = re.compile(r"^[a-z][\w-]*$")


def commands_in(text: str) -> list[list[str]]:
    """Every `duospec ...` command in a shell snippet, as argv without the program name. Quoted
    strings are searched too (`bash -c "... && exec duospec serve ..."`)."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
        for i, token in enumerate(tokens):
            if " " in token:
                found += commands_in(token)
            rest = tokens[i + 1:]
            if token.rsplit("/", 1)[-1] == "duospec" and rest and SUBCOMMAND.match(rest[0]):
                found.append(argv_until_operator(rest))
    return found


def argv_until_operator(tokens: list[str]) -> list[str]:
    argv = []
    for j, token in enumerate(tokens):
        redirected_fd = token.isdigit() and j + 1 < len(tokens) and tokens[j + 1][0] in "<>"  # the 2 of `2>&1`
        if SHELL_OPERATOR.match(token) or redirected_fd:
            break
        argv.append(token)
    return argv


def yaml_strings(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from yaml_strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from yaml_strings(value)


def deploy_commands() -> list[tuple[str, list[str]]]:
    """(source, argv) for commands the deployment runs: YAML values in deploy/ (not comments)."""
    found = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            for text in yaml_strings(doc):
                found += [(str(path.relative_to(REPO)), argv) for argv in commands_in(text)]
    return found


def readme_commands() -> list[tuple[str, list[str]]]:
    text = (DEPLOY / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^[ \t]*```[a-z]*\n(.*?)^[ \t]*```", text, flags=re.S | re.M)
    lines = "\n".join(line for block in blocks for line in block.splitlines() if not line.lstrip().startswith("#"))
    return [("deploy/README.md", argv) for argv in commands_in(lines)]


def flag_values(argv: list[str]) -> dict[str, str]:
    """`--flag value` / `--flag=value` pairs (booleans map to "")."""
    values, i = {}, 0
    while i < len(argv):
        token = argv[i]
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            values[name] = value
        i += 1
    return values


def head_pod_spec() -> dict:
    return the_doc("RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]


def head_serve_flags() -> dict[str, str]:
    container = head_pod_spec()["containers"][0]
    [argv] = [a for text in yaml_strings(container) for a in commands_in(text) if a[0] == "serve"]
    return flag_values(argv[1:])
