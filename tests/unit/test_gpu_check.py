"""benchmarks/gpu_check.sh on a machine without a GPU: it says so, exits 0 and writes nothing."""

from __future__ import annotations

import os
import re
import pathlib
import subprocess
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script would really run")
def test_gpu_check_refuses_to_pretend_without_a_gpu(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device here" in proc.stdout and "nothing was run or measured" in proc.stdout
    assert not out.exists()


def test_gpu_check_runs_the_device_tests_that_exist():
    """Every test file, test and benchmark the script names is there (a rename must not silently drop one)."""
    root = SCRIPT.parents[1]
    named = re.findall(r"(?:tests|benchmarks)/[\w./]+?\.(?:py|sh)(?:::\w+)?", SCRIPT.read_text())
    assert any(t.startswith("tests/") for t in named) and "benchmarks/verify_rule.py" in named
    for token in named:
        file, _, node = token.partition("::")
        assert (root / file).is_file(), token
        assert not node or f"def {node}(" in (root / file).read_text(), token
