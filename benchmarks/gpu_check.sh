#!/usr/bin/env bash
# The one-shot GPU check (issue 18): engine parity and greedy exactness on CUDA, then `duospec bench`
# and the KV-size benchmark on the GPU, tables written to one folder. Under 8 minutes on one GPU.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # OUT_DIR default: $OUT, else gpu-check-out
#
# On a machine without a CUDA device it says so and exits 0, having run and written nothing.
#
# Installs: duospec itself (pip --no-deps, no network needed), plus any wheels in .whl/ (for a
# machine with no registry: `bash benchmarks/gpu_wheels.sh` downloads, on a machine that has one, the
# packages a stock PyTorch image tends to lack or hold too old — protobuf, grpcio). Without Ray (its
# wheel is ~80 MB) the bench runs its in-process modes only, both models in one process on the one
# GPU — colocated by construction; with Ray it adds the server runs with `--placement colocated`.
# Writes into OUT_DIR: gpu.txt (device), tests.txt (pytest), bench/results.{md,json,png}, kv_context.md,
# verify_rule.md, and with three GPUs and Ray tensor_parallel.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-gpu-check-out}}"
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA device here (torch.cuda.is_available() is false for $PY): nothing was run" \
         "or measured. Run this script on a machine with an NVIDIA GPU."
    exit 0
fi
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
started=$(date +%s)
step() { echo "== gpu_check [$(( $(date +%s) - started )) s] $*"; }

step "install"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/duospec-site \
        .whl/*.whl && export PYTHONPATH="/tmp/duospec-site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -3
missing=$("$PY" - <<'PY'
import importlib.util as u
need = ["torch", "transformers", "tokenizers", "safetensors", "numpy", "scipy", "pytest", "grpc", "google.protobuf",
        "yaml", "tqdm"]
print(" ".join(n for n in need if u.find_spec(n) is None))
PY
)
if [ -n "$missing" ]; then
    echo "gpu_check: missing Python packages: $missing (carry them as wheels in .whl/: benchmarks/gpu_wheels.sh)"
fi
has_ray=$("$PY" -c "import importlib.util as u; print(int(u.find_spec('ray') is not None))")

step "device"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  echo "ray installed: $has_ray"; } | tee "$OUT_DIR/gpu.txt"

step "engine parity, bf16 exactness and the batched verify rule on CUDA"
DUOSPEC_TEST_DEVICE=cuda timeout 240 "$PY" -m pytest -q -p no:cacheprovider -W default \
    tests/engine/test_engine.py::test_lean_matches_transformers tests/engine/test_bf16_exactness.py tests/unit/test_verify_batch.py 2>&1 | tee "$OUT_DIR/tests.txt" | tail -15
tests_rc=${PIPESTATUS[0]}

step "duospec bench --models models --device cuda (the bundled pair: nothing is pulled on the device)"
server_flags=(--skip-server)
if [ "$has_ray" = 1 ]; then server_flags=(--placement colocated --concurrency 1,4); fi
timeout 240 "$PY" -m duospec bench --models models --device cuda "${server_flags[@]}" --limit-prompts 4 --repeats 2 \
    --max-new-tokens 64 --no-progress --out "$OUT_DIR/bench" 2>&1 | tail -40
bench_rc=${PIPESTATUS[0]}

step "KV cache size vs decode step time on CUDA"
timeout 90 "$PY" benchmarks/kv_context.py --device cuda --max-model-len 1024 8192 32768 --repeats 30 2>&1 \
    | grep -v -i "loading weights" | tee "$OUT_DIR/kv_context.md"
kv_rc=${PIPESTATUS[0]}

step "the verify rule: reference on the host vs batched on CUDA"
timeout 60 "$PY" benchmarks/verify_rule.py --device cuda --vocab 32000 128256 --items 1 8 32 --repeats 20 2>&1 \
    | tee "$OUT_DIR/verify_rule.md"
verify_rc=${PIPESTATUS[0]}

tp_rc=0
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$has_ray" = 1 ] && [ "$gpus" -ge 3 ]; then
    step "tensor parallelism: off through the server at TP=1 and TP=2 (NCCL), side by side"
    timeout 240 "$PY" benchmarks/tensor_parallel.py --device cuda --rounds 2 --streams 1 4 2>&1 \
        | grep -v -i "loading weights" | tee "$OUT_DIR/tensor_parallel.md"
    tp_rc=${PIPESTATUS[0]}
else
    step "tensor parallelism: skipped ($gpus GPU(s), ray installed: $has_ray; TP=1 and TP=2 side by side need three GPUs and Ray)"
fi

step "done: tests rc=$tests_rc, bench rc=$bench_rc, kv_context rc=$kv_rc, verify_rule rc=$verify_rc, tp rc=$tp_rc; tables in $OUT_DIR"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ] && [ "$kv_rc" = 0 ] && [ "$verify_rc" = 0 ] && [ "$tp_rc" = 0 ]
