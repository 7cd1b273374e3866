"""On real gloo ranks: only the driver (rank 0) loads the tokenizer and builds grammar state.

The non-driver rank of a tp-2 job that runs a JSON-schema request holds no
driver, and has imported neither transformers nor a grammar backend: its
memory is its shard, the KV pool and the step's buffers (docs/benchmarks.md,
"Weights held once").  Both ranks run with glibc's malloc thresholds fixed.
"""

import json
import sys

from tpguide.dist.spawn import run_on_ranks
from tpguide.engine import EngineConfig, build_engine
from tpguide.engine.request_io import parse_request_lines

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
REQUEST = {"id": "schema", "prompt": "Answer in JSON:", "structured_output": {"json": SCHEMA}, "max_tokens": 12}
CONFIG = EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=128)
DRIVER_ONLY = ("transformers", "tokenizers", "xgrammar", "llguidance")


def _driver_only_state(group, model_dir):
    """(whether this rank holds a driver, the driver-only modules it imported, the driver's text)."""
    engine = build_engine(group, model_dir, CONFIG)
    text = None
    if group.is_driver:
        text = engine.generate(parse_request_lines([json.dumps(REQUEST)], 12))[0].text
        engine.shutdown()
    else:
        engine.run_worker()
    return engine.driver is not None, sorted(m for m in DRIVER_ONLY if m in sys.modules), text


def test_only_the_driver_builds_tokenizer_and_grammar_state(tiny_model_path):
    (driver_held, driver_mods, text), (worker_held, worker_mods, none) = run_on_ranks(
        _driver_only_state, 2, tiny_model_path, timeout_s=200)
    assert driver_held and "transformers" in driver_mods  # what the check looks for is there on the driver
    assert any(m in driver_mods for m in ("xgrammar", "llguidance"))
    assert text.lstrip().startswith("{")  # the guided output (12 tokens of a random model: a prefix)
    assert not worker_held and worker_mods == [] and none is None
