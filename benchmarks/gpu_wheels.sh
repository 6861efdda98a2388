#!/usr/bin/env bash
# Downloads, into .whl/, the wheels benchmarks/gpu_check.sh installs on a GPU machine that cannot reach
# a package registry (a stock PyTorch image: Python 3.12, x86-64). Run it where pip works; the folder
# must travel with the checkout (it is git-ignored).
#
#   bash benchmarks/gpu_wheels.sh [PYTHON_VERSION]     # default 3.12
#
# protobuf and grpcio at the versions the checked-in generated code needs (pyproject.toml); Ray is
# left out (its wheel is ~80 MB); gpu_check.sh runs without it.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-3.12}"
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "protobuf==7.36.2" "grpcio==1.85.3" "grpcio-health-checking==1.85.1"
ls -la .whl
