"""The ``tpguide`` command and the ``python -m tpguide.generate|serve`` modules: the flags of launch/*.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tpguide.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_usage_and_unknown_command(capsys):
    assert main([]) == 2 and "usage: tpguide {generate,serve,replay}" in capsys.readouterr().err
    assert main(["train"]) == 2 and "unknown command 'train'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0 and "--tool-call-parser" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["replay", "--help"])
    assert info.value.code == 0 and "--force" in capsys.readouterr().out


def test_module_runs_with_the_launch_scripts_flags():
    """``python -m tpguide.generate`` (what ``torchrun -m tpguide.generate`` starts on each rank)."""
    out = subprocess.run([sys.executable, "-m", "tpguide.generate", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--requests" in out.stdout and "--max-num-seqs" in out.stdout
