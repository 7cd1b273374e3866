"""The main job end to end on the embedded real model: torchrun tp 2 == plain-python tp 1.

Runs ``launch/generate.py`` exactly as a user would (``python`` for tp 1,
``torchrun --nproc-per-node 2`` for tp 2) on a requests file with every guide
type, then checks that every guided output that finished with ``stop``
satisfies its constraint and that token ids are equal request by request.
"""

import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"\d{4}-\d{2}-\d{2}"
CHOICES = ["yes", "no"]
GRAMMAR = 'root ::= [1-9] [0-9]? " + " [1-9] [0-9]? " = " [0-9]+'


def _chat(text):
    return [{"role": "user", "content": text}]


REQUESTS = [
    {"id": "schema", "messages": _chat("A fictional person as JSON with name and age."),
     "structured_output": {"json": SCHEMA}},
    {"id": "object", "messages": _chat("The capital of France as a JSON object."),
     "structured_output": {"json_object": True}},
    {"id": "regex", "messages": _chat("Date of the Moon landing, YYYY-MM-DD?"),
     "structured_output": {"regex": REGEX}},
    {"id": "choice", "messages": _chat("Is water wet? yes or no"), "structured_output": {"choice": CHOICES}},
    {"id": "grammar", "messages": _chat("Add two numbers."), "structured_output": {"grammar": GRAMMAR}},
    {"id": "free", "messages": _chat("Say hello."), "max_tokens": 12},
]


def _run(cmd, tmp_path, name):
    out = tmp_path / f"{name}.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd + ["--requests", str(tmp_path / "req.jsonl"), "--output", str(out),
                                 "--max-new-tokens", "40", "--quiet"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.slow
def test_torchrun_tp2_equals_python_tp1_and_outputs_are_valid(tmp_path, default_model_path):
    (tmp_path / "req.jsonl").write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    tp1 = _run([sys.executable, "launch/generate.py"], tmp_path, "tp1")
    tp2 = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "launch/generate.py"], tmp_path, "tp2")
    assert [o["id"] for o in tp1] == [r["id"] for r in REQUESTS]
    for a, b in zip(tp1, tp2):
        assert a["token_ids"] == b["token_ids"], a["id"]
        assert a["finish_reason"] == b["finish_reason"]
    by_id = {o["id"]: o for o in tp1}
    assert all(o["finish_reason"] in ("stop", "length") for o in tp1)
    assert sum(o["finish_reason"] == "stop" for o in tp1) >= 4
    checks = {
        "schema": lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
        "object": lambda t: isinstance(json.loads(t), dict),
        "regex": lambda t: re.fullmatch(REGEX, t),
        "choice": lambda t: t in CHOICES,
        "grammar": lambda t: re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]? = [0-9]+", t),
    }
    for rid, check in checks.items():
        if by_id[rid]["finish_reason"] == "stop":
            assert check(by_id[rid]["text"]), (rid, by_id[rid]["text"])
