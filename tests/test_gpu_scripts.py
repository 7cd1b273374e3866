"""The GPU acceptance scripts' own logic, on CPU without a model: request sets, checks, model sharing, the table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import check_valid  # noqa: E402
import engine_runs  # noqa: E402
import gpu_exactness  # noqa: E402

from tpguide.engine.request_io import parse_request_lines  # noqa: E402

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 5}}, "required": ["a"]}


def _fixtures(tmp_path) -> Path:
    lines = [{"id": "j1", "messages": [{"role": "user", "content": "one"}], "structured_output": {"json": SCHEMA},
              "max_tokens": 256},
             {"id": "re", "messages": [{"role": "user", "content": "two"}], "structured_output": {"regex": "a+"}},
             {"id": "j2", "messages": [{"role": "user", "content": "three"}], "structured_output": {"json": SCHEMA},
              "temperature": 0.7}]
    path = tmp_path / "fixtures.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_json_schema_requests_cycle_the_json_rows_with_unique_ids(tmp_path):
    rows = engine_runs.json_schema_requests(_fixtures(tmp_path), 5, 128, logprobs=1)
    assert [r["id"] for r in rows] == ["j1", "j2", "j1#1", "j2#1", "j1#2"]
    assert {r["max_tokens"] for r in rows} == {128} and {r["temperature"] for r in rows} == {0.0}
    assert {r["logprobs"] for r in rows} == {1}
    assert [r["id"] for r in engine_runs.json_schema_requests(_fixtures(tmp_path), None, 8)] == ["j1", "j2"]
    assert [r["id"] for r in engine_runs.json_schema_requests(_fixtures(tmp_path), 2, 8, keep=["j2"])] == ["j2", "j2#1"]
    with pytest.raises(ValueError, match="no JSON-schema request"):
        engine_runs.json_schema_requests(_fixtures(tmp_path), 2, 8, keep=["re"])
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        engine_runs.json_schema_requests(tmp_path / "missing.jsonl", 2, 8)


def test_warm_up_variant_changes_prompts_and_ids_only(tmp_path):
    rows = engine_runs.json_schema_requests(_fixtures(tmp_path), 2, 8)
    warm = engine_runs.warm_up_variant(rows)
    assert [w["id"] for w in warm] == ["warm-up/j1", "warm-up/j2"]
    assert warm[0]["messages"][-1]["content"] == "(warm-up) one" and rows[0]["messages"][-1]["content"] == "one"
    assert warm[0]["structured_output"] == rows[0]["structured_output"]


def test_check_valid_flags_failed_invalid_and_missing_rows_only():
    requests = parse_request_lines([json.dumps({"id": i, "prompt": "x", "structured_output": {"json": SCHEMA}})
                                    for i in ("ok", "cut", "bad", "err", "lost")], 8)
    outputs = {"ok": {"finish_reason": "stop", "text": '{"a": 3}'},
               "cut": {"finish_reason": "length", "text": '{"a": 3'},
               "bad": {"finish_reason": "stop", "text": '{"a": 7}'},
               "err": {"finish_reason": "error", "error": "boom"}}
    found = check_valid.problems(outputs, requests)
    assert [f.split(":")[0] for f in found] == ["bad", "err", "lost"]
    assert "maximum" in found[0]


def test_invalid_outputs_are_the_validation_errors():
    lines = [{"id": "a", "finish_reason": "error", "error": "output fails its json: 7 is greater than ..."},
             {"id": "b", "finish_reason": "error", "error": "grammar refused"},
             {"id": "c", "finish_reason": "stop", "error": None}]
    assert engine_runs.invalid_outputs(lines) == ["a: output fails its json: 7 is greater than ..."]


def test_shared_model_loads_loads_each_key_once_and_restores_the_loader(monkeypatch):
    from tpguide.dist import TPGroup
    from tpguide.model import loader

    calls = []

    def fake_load(model_dir, group, dtype, **kwargs):
        calls.append((model_dir, dtype, kwargs))
        return object()

    monkeypatch.setattr(loader, "load_model", fake_load)
    group = TPGroup()
    with engine_runs.shared_model_loads() as cache:
        a = loader.load_model("m", group, "bf16", tp_invariant=True)
        b = loader.load_model("m", group, "bf16", tp_invariant=True)
        c = loader.load_model("m", group, "bf16", tp_invariant=False)
        assert a is b and a is not c and len(cache) == 2
    assert len(calls) == 2 and loader.load_model is fake_load


def test_a_changed_logprob_is_a_difference():
    ref = [{"id": "a", "token_ids": [1, 2], "logprobs": [-0.5, -0.25]}, {"id": "b", "token_ids": [3],
                                                                         "logprobs": [-1.0]}]
    other = [dict(ref[0], logprobs=[-0.5, -0.25000001]), ref[1]]
    same_ids, same_lp, with_lp, differing = gpu_exactness.compare_lines(ref, other)
    assert (same_ids, same_lp, with_lp, differing) == (2, 1, 2, ["a"])
    row = gpu_exactness.Row("fixtures", "same run twice", 2, same_ids, same_lp, with_lp)
    assert not row.identical
    assert gpu_exactness.Row("fixtures", "same run twice", 2, 2, 2, 2).identical


def test_variants_cover_the_issue_comparisons():
    from tpguide.engine import EngineConfig

    names = [v[0] for v in gpu_exactness.variants(EngineConfig(max_num_seqs=32), 32, 8, 32)]
    assert names[:1] == ["same run twice"]
    assert {"first 8 of 32 vs a 8-row run", "grammar drafts vs none", "prefix cache on vs off",
            gpu_exactness.ALONE} <= set(names)
    configs = {v[0]: v[1] for v in gpu_exactness.variants(EngineConfig(max_num_seqs=32), 32, 8, 32)}
    assert configs["grammar drafts vs none"].speculative_method is None
    assert configs["prefix cache on vs off"].enable_prefix_caching is False
    assert configs[gpu_exactness.ALONE].max_num_seqs == 1
