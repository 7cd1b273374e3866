#!/usr/bin/env bash
# Wheels for a GPU machine without a package index: download (here, where pip works) the cp312 manylinux
# wheels of what tpguide needs beyond the GPU image's torch / triton / transformers, pinned to the versions
# installed here, into .whl/ (git-ignored); llguidance 1.9 needs glibc >= 2.31 (manylinux_2_31).
# See docs/gpu-acceptance.md.
#   usage: bash launch/gpu_wheels.sh [DEST]        (default DEST: .whl)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DEST="${1:-.whl}"
mkdir -p "$DEST"

# The roots and, through their installed metadata, every requirement they pull in (extras and
# markers evaluated for CPython 3.12 on Linux), except what the GPU image already has: torch,
# triton, transformers and their own dependencies (big wheels, and the image's versions must win).
mapfile -t PINS < <("$PY" - <<'EOF'
import importlib.metadata as md
import re

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOTS = ["xgrammar", "llguidance", "pydantic", "jsonschema", "fastapi", "uvicorn", "openai",
         "prometheus_client", "hypothesis"]
ON_IMAGE = {"torch", "triton", "transformers", "numpy", "tokenizers", "safetensors", "huggingface-hub",
            "hf-xet", "regex", "pyyaml", "filelock", "packaging", "tqdm", "fsspec", "jinja2", "markupsafe",
            "sympy", "mpmath", "networkx", "setuptools", "typer", "shellingham", "rich", "pygments",
            "markdown-it-py", "mdurl"}
env = dict(default_environment(), python_version="3.12", python_full_version="3.12.3",
           sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
           implementation_name="cpython", platform_python_implementation="CPython")


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


seen, todo = {}, list(ROOTS)
while todo:
    name = norm(todo.pop())
    if name in seen or name in ON_IMAGE or name.startswith("nvidia-"):
        continue
    dist = md.distribution(name)  # PackageNotFoundError: install it here first
    seen[name] = dist.version
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate(dict(env, extra="")):
            todo.append(req.name)
for name, version in sorted(seen.items()):
    print(f"{name}=={version}")
EOF
)
echo "[gpu_wheels] ${#PINS[@]} pinned packages: ${PINS[*]}"
"$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$DEST" "${PINS[@]}"

# one version of each package: drop wheels of an earlier run that are not pinned now
"$PY" - "$DEST" "${PINS[@]}" <<'EOF'
import os
import re
import sys

dest = sys.argv[1]
pins = {(re.sub(r"[-_.]+", "_", name).lower(), version) for name, version in (p.split("==") for p in sys.argv[2:])}
for wheel in sorted(os.listdir(dest)):
    if not wheel.endswith(".whl"):
        continue
    name, version = wheel.split("-")[:2]
    if (re.sub(r"[-_.]+", "_", name).lower(), version) not in pins:
        os.remove(os.path.join(dest, wheel))
        print(f"[gpu_wheels] removed {wheel} (not pinned now)")
EOF
ls -la "$DEST"
echo "[gpu_wheels] $(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST"
