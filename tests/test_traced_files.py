"""The files one guided request runs (``launch/count_traced_files.py``) are exactly docs/architecture.md §1's list."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def documented_files() -> list:
    """The numbered list of "The default guided path, file by file", as ``tpguide/...`` paths."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("### The default guided path, file by file", 1)[1].split("\n###", 1)[0]
    return ["tpguide/" + m for m in re.findall(r"^\d+\. `([^`]+\.py)`", section, flags=re.M)]


@pytest.mark.slow
def test_traced_files_equal_the_documented_list(default_model_path):
    """The counter's files (any order: threads race) = the documented ones, and its total = the list's length."""
    out = subprocess.run([sys.executable, str(ROOT / "launch" / "count_traced_files.py"),
                          "--model", default_model_path],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    traced = [line for line in lines if line.startswith("tpguide/")]
    documented = documented_files()
    assert len(documented) == len(set(documented))
    assert sorted(traced) == sorted(documented), (sorted(set(traced) - set(documented)),
                                                  sorted(set(documented) - set(traced)))
    assert lines[-1].startswith(f"{len(documented)} files of tpguide/")
