"""What installing duospec puts in site-packages: one top-level package, and a base install that is
only the client (the SDK and the client commands), without torch or Ray."""

from __future__ import annotations

import ast
import asyncio
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from duospec.v1 import generation_pb2 as pb  # noqa: F401  (the server below needs the generated code)
from server_support import running_server

REPO = Path(__file__).resolve().parents[2]
STAGES = ("coordinator", "cluster", "draft_worker", "target_worker")


def _tracked_python_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / line for line in out.split()]


def test_no_code_imports_a_pipeline_folder_as_a_top_level_module():
    """`coordinator.x` would load a second copy of the module beside `duospec.coordinator.x`."""
    offenders = []
    for path in _tracked_python_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            offenders += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names if n.split(".")[0] in STAGES]
    assert not offenders, offenders


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(REPO)], check=True, capture_output=True)
    [built] = out.glob("duospec-*.whl")
    return built


def test_the_wheel_has_one_top_level_package_and_a_client_only_base(wheel):
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/")[0] for name in zf.namelist()}
        metadata = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        names = zf.namelist()
    assert tops == {"duospec", wheel.name.split("-py3")[0] + ".dist-info"}, tops
    for stage in STAGES:
        assert f"duospec/{stage}/scheduler.py" in names or f"duospec/{stage}/__init__.py" in names, stage
    base = sorted(line.split()[1].split(">")[0].split("=")[0] for line in metadata.splitlines()
                  if line.startswith("Requires-Dist:") and "extra ==" not in line)
    assert base == ["grpcio", "grpcio-health-checking", "protobuf"], base
    serve = [line for line in metadata.splitlines() if 'extra == "serve"' in line]
    assert any("torch" in line for line in serve) and any("ray" in line for line in serve)


@pytest.mark.slow  # a fresh venv and a pip install of the wheel and its dependencies: minutes
@pytest.mark.timeout(900)  # the pip install alone may take up to 600 s, past the global 300 s
async def test_a_base_install_calls_a_server_with_the_sdk_and_has_no_torch_or_ray(wheel, tmp_path, tiny_pair):
    env_dir = tmp_path / "client-venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", str(wheel)], check=True, capture_output=True,
                   timeout=600)
    freeze = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True,
                            text=True, check=True).stdout.lower()
    installed = {line.split("==")[0] for line in freeze.split()}
    assert not installed & {"torch", "ray", "transformers", "numpy"}, installed
    from server_support import TargetOnlyCoordinator

    async with running_server(TargetOnlyCoordinator(*tiny_pair)) as h:
        script = ("import duospec, importlib.util as u\n"
                  "assert u.find_spec('torch') is None and u.find_spec('ray') is None\n"
                  f"with duospec.Client('127.0.0.1:{h.server.port}', timeout=60) as c:\n"
                  "    r = c.generate('def f():', max_new_tokens=3, ignore_eos=True)\n"
                  "    print(len(r.token_ids), r.finish_reason)\n")
        clean_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = await asyncio.create_subprocess_exec(str(python), "-c", script, cwd=str(tmp_path), env=clean_env,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()
        assert out.decode().split() == ["3", "length"]
        cli = await asyncio.create_subprocess_exec(str(env_dir / "bin" / "duospec"), "generate", "def f():",
                                                   "--max-tokens", "2", "--address", f"127.0.0.1:{h.server.port}",
                                                   cwd=str(tmp_path), env=clean_env,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(cli.communicate(), 120)
        assert cli.returncode == 0, err.decode()
    serve = subprocess.run([str(env_dir / "bin" / "duospec"), "serve"], capture_output=True, text=True,
                           cwd=str(tmp_path), env=clean_env)
    assert serve.returncode != 0 and "duospec[serve]" in serve.stderr and "Traceback" not in serve.stderr
