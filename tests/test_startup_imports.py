"""A guided request imports no compiler stack: no ``llguidance.torch``, ``torch._dynamo`` or ``torch._inductor``.

``llguidance.torch`` decorates a function with ``torch.compile`` at import
time, which pulls in dynamo and inductor (seconds); the grammar backends'
tokenizer tables are built at engine start-up, so the first guided request
waits for neither (docs/benchmarks.md, first-request latency).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPILER_MODULES = ("llguidance.torch", "torch._dynamo", "torch._inductor")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"],
          "additionalProperties": False}
PROBE = """
import json, runpy, sys
sys.path.insert(0, "launch")
engine_module = __import__("tpguide.engine.engine", fromlist=["Engine"])
seen = {}
original_step = engine_module.Engine.step
def step(self, *args, **kwargs):
    seen.setdefault("before_first_step", [m for m in %r if m in sys.modules])
    return original_step(self, *args, **kwargs)
engine_module.Engine.step = step
status = runpy.run_path("launch/generate.py", run_name="probe")["run"](json.loads(sys.argv[1]))
assert status == 0, status
seen["after"] = [m for m in %r if m in sys.modules]
print("MODULES " + json.dumps(seen))
""" % (COMPILER_MODULES, COMPILER_MODULES)


@pytest.mark.parametrize("backend", ["auto", "llguidance"])
def test_guided_requests_import_no_compiler(tiny_model_path, tmp_path, backend):
    requests = tmp_path / "in.jsonl"
    lines = [{"id": str(i), "prompt": "A name:", "structured_output": {"json": SCHEMA}, "max_tokens": 24}
             for i in range(2)]
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    argv = ["--model", tiny_model_path, "--requests", str(requests), "--output", str(out), "--quiet", "--threads", "1",
            "--guided-backend", backend]
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argv)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.split("MODULES ", 1)[1])
    assert seen == {"before_first_step": [], "after": []}, seen
    outputs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [o["id"] for o in outputs] == ["0", "1"]
    for o in outputs:
        assert o["finish_reason"] in ("stop", "length"), o
        if o["finish_reason"] == "stop":
            jsonschema.validate(json.loads(o["text"]), SCHEMA)
