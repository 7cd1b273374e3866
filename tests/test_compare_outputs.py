"""benchmarks/compare_outputs.py: identical and differing token ids / logprobs are told apart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compare_outputs.py"


def _write(path: Path, lines) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_compare_outputs_counts_and_exit_code(tmp_path):
    ref = [{"id": "a", "token_ids": [1, 2], "logprobs": [-0.5, -0.25]}, {"id": "b", "token_ids": [3]}]
    same = _write(tmp_path / "same.jsonl", list(reversed(ref)))
    other = _write(tmp_path / "other.jsonl", [{"id": "a", "token_ids": [1, 2], "logprobs": [-0.5, -0.5]},
                                              {"id": "b", "token_ids": [4]}])
    reference = _write(tmp_path / "ref.jsonl", ref)
    ok = subprocess.run([sys.executable, str(SCRIPT), reference, same], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "identical token ids 2/2, identical logprobs 1/1" in ok.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), reference, other], capture_output=True, text=True)
    assert bad.returncode == 1
    assert "identical token ids 1/2, identical logprobs 0/1; differ: a, b (token ids)" in bad.stdout
