"""The guide check (docs/receipts.md) says what generation says: the same verdict and reason, pointers that resolve.

One tp-1 run on the tiny random model generates (one token each) every strict guide of the fail-closed
tests and, where ``../shared/bench-data`` is present, every schema of the JSONSchemaBench sample; the guide
check runs on a backend of its own (``--check-guides``' backend, built from the tokenizer alone), so no
admission is shared through a cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_guided_fail_closed import EMPTY_FIRST_MASK, GOOD, UNSATISFIABLE, XGRAMMAR_UNENFORCED

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, generate_on_group
from tpguide.engine.guide_check_offline import check_request_lines, guide_backend
from tpguide.guided.guide_check import check_guide
from tpguide.guided.schema_check import json_pointer_get

BENCH = Path(__file__).resolve().parents[2] / "shared" / "bench-data" / "jsonschemabench_sample.jsonl"
TYPO = {"type": "object", "propertieC": {"a": {"type": "integer"}}, "required": ["a"]}  # the fuzz's find
MISSING = object()
CYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                              "required": ["x"]}}}


def _guides():
    guides = {"good": {"json": GOOD}, "typo": {"json": TYPO}, "cycle": {"json": CYCLE},
              "lookaround": {"regex": "(?=a)a+"}, "one-choice": {"choice": ["x"]}}
    guides.update({f"unenforced:{case.key}": {"json": case.schema} for case in XGRAMMAR_UNENFORCED})
    guides.update({f"unsatisfiable:{name}": {"json": schema} for name, (schema, _) in UNSATISFIABLE.items()})
    guides.update({f"empty-first-mask:{name}": guide for name, guide in EMPTY_FIRST_MASK.items()})
    if BENCH.is_file():
        for line in BENCH.read_text().splitlines():
            row = json.loads(line)
            guides[f"bench:{row['path']}"] = {"json": row["schema"]}
    return guides


@pytest.fixture(scope="module")
def backend(tiny_model_path):
    """``--check-guides``' backend under ``auto`` (its own: no admission shared with generation's)."""
    return guide_backend(tiny_model_path, "auto", "bounded")


@pytest.fixture(scope="module")
def runs(tiny_model_path, backend):
    """``(guides, {id: generation's output line}, {id: the guide check's report})``."""
    guides = _guides()
    lines = [{"id": rid, "prompt": "x", "max_tokens": 1, "structured_output": guide} for rid, guide in guides.items()]
    generated = {o["id"]: o for o in generate_on_group(
        TPGroup(), tiny_model_path, lines, EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=32))}
    checked = {r["id"]: r for r in check_request_lines([json.dumps(line) for line in lines], backend, "bounded",
                                                       compile_timeout_s=60.0)}
    return guides, generated, checked


def test_the_check_refuses_exactly_what_generation_refuses_with_its_reason(runs):
    guides, generated, checked = runs
    assert set(checked) == set(generated) == set(guides)
    for rid, out in generated.items():
        report = checked[rid]
        refused_by_generation = out["finish_reason"] == "error" and out["token_ids"] == []
        assert report["admitted"] == (not refused_by_generation), (rid, report["error"], out["error"])
        if refused_by_generation:
            assert report["error"] and report["error"] in out["error"], rid  # the same message
            assert report["reasons"], rid
            document = next(iter(guides[rid].values()))
            for reason in report["reasons"]:
                assert json_pointer_get(document, reason["pointer"], MISSING) is not MISSING, (rid, reason)
                if reason["keyword"] is not None and reason["pointer"]:
                    assert reason["pointer"].rsplit("/", 1)[-1] == reason["keyword"], (rid, reason)
        else:
            assert report["backend"] == out["guided_backend"] and report["guide_hash"].startswith("sha256:"), rid
    for rid in ("typo", "cycle", "lookaround", *(r for r in guides if not r.startswith(("good", "bench", "one-")))):
        if rid.startswith("unenforced:"):
            continue  # auto may run an unenforced xgrammar keyword on llguidance
        assert not checked[rid]["admitted"], rid
    assert checked["good"]["admitted"]


def test_reasons_name_the_keyword_and_its_pointer(runs):
    _, _, checked = runs
    (typo,) = {(r["pointer"], r["keyword"]) for r in checked["typo"]["reasons"]}
    assert typo == ("/required", "required") and checked["typo"]["keywords"]["xgrammar"]["unknown"] == ["/propertieC"]
    assert [(r["pointer"], r["keyword"]) for r in checked["cycle"]["reasons"]] == [("/$defs/a/properties/x/$ref", "$ref")]
    anyof = checked["unsatisfiable:anyof-empty"]["reasons"]
    assert [(r["pointer"], r["keyword"]) for r in anyof] == [("/anyOf", "anyOf")]
    good = checked["good"]["keywords"][checked["good"]["backend"]]
    assert good["enforced"] == ["/type", "/properties", "/properties/ok/type", "/required"] and not good["refused"]


def test_best_effort_lists_what_is_checked_after_generation(backend):
    xgrammar = backend.backends["xgrammar"]
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    strict, best = check_guide(xgrammar, {"json": schema}), check_guide(xgrammar, {"json": schema, "strict": False})
    assert not strict["admitted"] and strict["keywords"]["xgrammar"]["refused"] == ["/uniqueItems"]
    assert best["admitted"] and best["keywords"]["xgrammar"]["checked_after_generation"] == ["/uniqueItems"]
    assert strict["guide_hash"] == best["guide_hash"] and best["compile_time_s"] >= 0


def test_a_guide_slower_than_the_compile_timeout_is_refused_with_generations_message(backend, monkeypatch):
    import time

    from tpguide.guided import guide_check
    from tpguide.guided.compile_service import CompileService

    real = guide_check.admit
    monkeypatch.setattr(guide_check, "admit", lambda *args: time.sleep(0.3) or real(*args))
    report = check_guide(backend, {"regex": "[0-9]{3}"}, compiles=CompileService(0.05))
    assert not report["admitted"] and report["error"] == (
        "grammar compilation took longer than the limit of 0.05 s (--grammar-compile-timeout); "
        "the request was not started")


def test_forced_tokens_in_receipts_equal_a_matcher_walk(runs, backend):
    """The first output token of each admitted guide counts as forced iff a fresh matcher's mask allows one id."""
    from tpguide.guided.admission import admit
    from tpguide.guided.bitmask import allocate_token_bitmask, single_allowed_token
    from tpguide.guided.params import StructuredOutputsParams

    guides, generated, _ = runs
    forced = 0
    for rid, out in generated.items():
        if not out["token_ids"]:
            continue
        _, compiled = admit(backend, StructuredOutputsParams.from_request(guides[rid]))
        row = allocate_token_bitmask(1, backend.padded_vocab_size)
        backend.matcher(compiled).fill_next_token_bitmask(row, 0)
        single = single_allowed_token(row[0], backend.padded_vocab_size)
        assert out["receipt"]["enforcement"]["forced_tokens"] == int(single is not None), rid
        assert single is None or out["token_ids"][0] == single, rid
        forced += single is not None
    assert forced >= 1  # the one-choice guide at least


def test_a_keyword_a_backend_does_not_compile_is_refused_in_its_table_not_enforced():
    """llguidance does not compile ``uniqueItems`` (a new-user trial saw it listed as enforced)."""
    from tpguide.guided.guide_check import _keyword_table, not_compiled_keywords

    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    assert not_compiled_keywords(schema, "llguidance") == [("/uniqueItems",
                                                           "'uniqueItems' is not compiled by llguidance")]
    assert not_compiled_keywords(schema, "xgrammar") == []  # xgrammar compiles it, without enforcing it
    for name in ("llguidance", "xgrammar"):
        table = _keyword_table(schema, name, strict=True)
        assert table["refused"] == ["/uniqueItems"] and "/uniqueItems" not in table["enforced"], (name, table)
    assert _keyword_table(schema, "llguidance", strict=False)["refused"] == ["/uniqueItems"]
