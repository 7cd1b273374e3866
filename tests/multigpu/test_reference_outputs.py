"""Token ids equal those of the engine before the step-loop rebuild (commit 5d3fc53), at tp 1, 2 and 4.

``tests/reference/outputs_5d3fc53.json`` was written by
``tests/reference/generate_reference.py`` run on that commit: every request
set of the engine tests (request lines, engine limits, default
``max_tokens``) on the tiny random-weight model, and the built-in demo plus
the real-model requests on the embedded model, with their token ids and
finish reasons at each tp size.  It is never regenerated from the code it
checks.  The tiny sets run at tp 1, 2 and 4; the embedded model's at tp 1
and 2: the tiny model has the embedded model's heads (9 query, 3 KV), so
tp 4 pads them with the same code.
"""

import json
from pathlib import Path

import pytest

from tpguide.dist.spawn import run_at_tp_size

REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "outputs_5d3fc53.json"
SETS = json.loads(REFERENCE.read_text())["sets"]


def run_sets(group, model_paths, sets):
    """Module-level (spawnable): each set on a fresh engine; every rank returns the driver's outputs per set."""
    from tpguide.dist import group as C
    from tpguide.engine import EngineConfig, build_engine
    from tpguide.engine.request_io import parse_request_lines

    results = []
    for s in sets:
        # the old engine's guide behaviour: its backend (stored) and unbounded JSON whitespace (no such option then)
        config = EngineConfig(**{"json_whitespace": "any", **s["config"]})
        engine = build_engine(group, model_paths[s["model"]], config)
        out = None
        if group.is_driver:
            out = [{"id": o.request_id, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                   for o in engine.generate(parse_request_lines(s["lines"], s["default_max_tokens"]))]
            engine.shutdown()
        else:
            engine.run_worker()
        results.append(C.broadcast_object(out, group))
    return results


def _check(model, tp_size, paths):
    sets = [s for s in SETS if s["model"] == model]
    got = run_at_tp_size(run_sets, tp_size, paths, sets)[0]
    for s, outputs in zip(sets, got, strict=True):
        assert outputs == s["outputs"][str(tp_size)], s["name"]


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_tiny_model_sets_equal_the_old_engine(tiny_model_path, tp_size):
    _check("tiny", tp_size, {"tiny": tiny_model_path})


@pytest.mark.slow
@pytest.mark.parametrize("tp_size", [1, 2])  # tp 4 pads the same 9 / 3 heads as the tiny model's sets above
def test_demo_and_real_model_requests_equal_the_old_engine(default_model_path, tp_size):
    _check("default", tp_size, {"default": default_model_path})
