"""Grammar drafts on the embedded model (tp 1): same tokens and logprobs, most forced drafts accepted.

A real model writes the property names and the tool-call header a grammar
forces the way the tokenizer splits them, so here the drafts are mostly
accepted (the tiny random model of ``tests/multigpu/test_engine_grammar_draft.py``,
which covers both backends, tp 2 and named tool calls, often splits them
otherwise).  The JSON-schema demo request and a tool call with
``tool_choice`` "required", on xgrammar: two engine runs.
"""

from __future__ import annotations

import pytest
from grammar_draft_testing import key, run, tool_call_lines

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig
from tpguide.engine.demo_requests import DEMO_REQUESTS
from tpguide.model.dtype import resolve_dtype

pytestmark = pytest.mark.slow
BASE = dict(max_num_seqs=4, max_num_batched_tokens=1024, max_model_len=1024, dtype=resolve_dtype("auto", "cpu"))


def test_real_model_accepts_forced_text_and_changes_no_token(default_model_path, backend="xgrammar"):
    demo = next(r for r in DEMO_REQUESTS if r["id"] == "json-schema")
    required = tool_call_lines(backend)[0]
    lines = [{**demo, "max_tokens": 32, "logprobs": 1}, {**required, "max_tokens": 32}]
    plain, _ = run(TPGroup(), default_model_path, lines,
                   EngineConfig(**BASE, guided_backend=backend, speculative_method=None))
    outputs, stats = run(TPGroup(), default_model_path, lines, EngineConfig(**BASE, guided_backend=backend))
    assert key(outputs) == key(plain)
    assert all(o["finish_reason"] in ("stop", "length") for o in outputs), [o["error"] for o in outputs]
    assert stats.num_forced_accepted >= 0.8 * stats.num_forced_drafted > 0, stats
    assert stats.num_sample_passes <= 0.8 * stats.num_generated_tokens, stats  # the tool call's header


def test_json_layouts_save_passes_and_change_no_token(default_model_path, monkeypatch):
    """The demo's JSON (the model writes ``json.dumps(indent=2)``): its layout drafts the indentation too.

    ``LAYOUT_COMPILE_BUDGET = 0``: no guide is quick enough for layouts, so only forced text is drafted.
    """
    import tpguide.engine.intake as intake

    demo = next(r for r in DEMO_REQUESTS if r["id"] == "json-schema")
    lines = [{**demo, "id": f"j{i}", "max_tokens": 48, "logprobs": 1} for i in range(2)]
    with_layouts, stats = run(TPGroup(), default_model_path, lines, EngineConfig(**BASE))
    monkeypatch.setattr(intake, "LAYOUT_COMPILE_BUDGET", 0.0)
    forced_only, forced_stats = run(TPGroup(), default_model_path, lines, EngineConfig(**BASE))
    assert key(with_layouts) == key(forced_only)
    assert with_layouts[0]["text"].startswith("{\n  "), with_layouts[0]["text"]
    assert stats.num_sample_passes < 0.8 * forced_stats.num_sample_passes, (stats, forced_stats)
