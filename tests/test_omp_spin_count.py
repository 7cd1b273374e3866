"""tpguide sets libgomp's spin count before torch loads it, unless the user set it (tpguide/__init__.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRINT = "import os, tpguide; print(os.environ.get('GOMP_SPINCOUNT'))"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return dict(env, **extra)


@pytest.mark.parametrize("extra,want", [({}, "10000"), ({"GOMP_SPINCOUNT": "42"}, "42"),
                                        ({"OMP_WAIT_POLICY": "PASSIVE"}, "None")])
def test_spin_count_default_and_user_choice(extra, want):
    out = subprocess.run([sys.executable, "-c", PRINT], env=_env(**extra), capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == want, out.stdout + out.stderr


@pytest.mark.parametrize("script", ["launch/generate.py", "launch/serve.py"])
def test_launch_scripts_import_tpguide_before_torch(script):
    """libgomp reads GOMP_SPINCOUNT when torch loads it: tpguide's init must have run first."""
    out = subprocess.run([sys.executable, "-X", "importtime", script, "--help"], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    names = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert "tpguide" in names and "torch" in names
    assert names.index("tpguide") < names.index("torch"), (names.index("tpguide"), names.index("torch"))
