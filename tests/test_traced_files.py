"""The step map of one decode step (``launch/step_map.py``) equals docs/architecture.md §1: its files and its calls back."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))

import step_map  # noqa: E402


def _section(title: str) -> str:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    return text.split(title, 1)[1].split("\n#", 1)[0]


def documented_files() -> list:
    """The numbered list of "One decode step, file by file", as ``tpguide/...`` paths."""
    section = _section("### One decode step, file by file")
    return ["tpguide/" + m for m in re.findall(r"^\d+\. `([^`]+\.py)`", section, flags=re.M)]


def documented_calls() -> set:
    """(kind, caller qualname, callee qualname) of each row of "Calls that send a reader back"."""
    rows = re.findall(r"^\| ([a-z ,]+) \| `([^`]+)` \(`[^`]+`\) \| `([^`]+)` \(`[^`]+`\) \|",
                      _section("#### Calls that send a reader back"), flags=re.M)
    calls = set()
    for kind, caller, callee in rows:
        if "against the layers" in kind:
            calls.add(("against the layers", caller, callee))
        if "handed in" in kind:
            calls.add(("handed in", caller, callee))
    return calls


def mapped_calls(edges: dict, kind: str) -> set:
    """``{"path:caller -> path:callee": n}`` as (kind, caller qualname, callee qualname)."""
    out = set()
    for edge in edges:
        caller, callee = (side.split(":", 1)[1] for side in edge.split(" -> "))
        out.add((kind, caller, callee))
    return out


def test_the_layers_are_those_of_the_import_check():
    from test_dependency_direction import LAYERS

    assert step_map.LAYERS == LAYERS


@pytest.mark.slow
def test_step_map_equals_the_documented_step(tiny_model_path):
    """The map's files (any order: the fill thread races) and its calls back = architecture.md §1."""
    out = subprocess.run([sys.executable, str(ROOT / "launch" / "step_map.py"), "--model", tiny_model_path, "--json"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    m = json.loads(out.stdout[out.stdout.index("{"):])
    assert m["new_tokens"] >= 1 and m["code_lines"] > 0
    documented = documented_files()
    assert len(documented) == len(set(documented))
    assert sorted(m["files"]) == sorted(documented), (sorted(set(m["files"]) - set(documented)),
                                                      sorted(set(documented) - set(m["files"])))
    calls = mapped_calls(m["against_layers"], "against the layers") | mapped_calls(m["handed_in"], "handed in")
    assert calls == documented_calls(), (sorted(calls - documented_calls()), sorted(documented_calls() - calls))
