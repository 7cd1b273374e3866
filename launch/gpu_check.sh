#!/usr/bin/env bash
# Bitmask kernels on a machine with a CUDA GPU: the kernel tests (their CUDA
# cases run the compiled Triton kernel and the torch path on the GPU; the CPU
# cases, the Triton interpreter included, run too), then the benchmark against
# xgrammar's triton and cuda backends.  Exits non-zero on the first failure.
#   usage: bash launch/gpu_check.sh [--quick]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "[gpu_check] no CUDA device visible to torch" >&2
    exit 1
fi
"$PY" -c "import torch; print('[gpu_check]', torch.cuda.get_device_name(0), 'torch', torch.__version__)"

echo "[gpu_check] kernel tests"
timeout 900 "$PY" -m pytest -q tests/test_kernels_reference.py tests/test_kernels_torch.py tests/test_kernels_triton.py

echo "[gpu_check] benchmark (cuda)"
timeout 900 "$PY" benchmarks/bench_bitmask.py --device cuda "$@"
echo "[gpu_check] ok"
