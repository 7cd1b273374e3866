"""jsonschema imported by tpguide loads rfc3987_syntax only at the first IRI check, with the plain import's verdicts."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

VALUES = ["http://example.com/a", "http://example.com/a b", "https://例え.jp/パス?q=ü#f", "//host/path", "a/b?c",
          "http://[::1]:80/", "http://[zz]/", "", "ht tp://x", "mailto:x@y.z", 7]

# prints [loaded after import, loaded after checks, verdicts]; argv[1]: "lazy" (tpguide's import) or "plain"
SCRIPT = """
import json, sys
if sys.argv[1] == "lazy":
    from tpguide.guided.schema_check import import_jsonschema
    jsonschema = import_jsonschema()
else:
    import jsonschema
after_import = "rfc3987_syntax" in sys.modules
verdicts = []
for fmt in ("iri", "iri-reference"):
    cls = jsonschema.Draft202012Validator
    validator = cls({"format": fmt}, format_checker=cls.FORMAT_CHECKER)
    verdicts.append([validator.is_valid(v) for v in json.loads(sys.argv[2])])
real = sys.modules.get("rfc3987_syntax")
print(json.dumps([after_import, real is not None and hasattr(real, "syntax_parser"), verdicts]))
"""


def _run(mode):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode, json.dumps(VALUES)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(importlib.util.find_spec("rfc3987_syntax") is None, reason="rfc3987_syntax is not installed")
def test_iri_checks_load_rfc3987_syntax_late_and_agree_with_the_plain_import():
    lazy_loaded_at_import, lazy_loaded_after, lazy = _run("lazy")
    plain_loaded_at_import, _, plain = _run("plain")
    assert plain_loaded_at_import and not lazy_loaded_at_import  # not loaded (nor its stand-in left) by the import
    assert lazy_loaded_after  # the first IRI check imported the real module
    assert lazy == plain
    assert True in lazy[0] and False in lazy[0]  # the values exercise both verdicts
