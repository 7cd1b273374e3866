"""Fail closed, end to end (tp 1, tiny random model): refused up front, auto falls back, best effort is validated.

For every keyword a backend does not enforce (tpguide/guided/enforcement.py),
for the three unsatisfiable schemas and for grammars whose first
mask is empty:

* the request is refused before it runs, with a message naming the cause;
* under ``auto`` it runs on the other backend where that one enforces it;
* with ``"strict": false`` it runs, and an output that violates the schema
  finishes ``"error"`` (text and token ids kept), never ``"stop"``.
"""

import pytest

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, generate_on_group
from tpguide.guided.enforcement import ENFORCED, MEASURED, NOT_ENFORCED
from tpguide.guided.keyword_cases import KEYWORD_CASES
from tpguide.guided.schema_check import validator_for_schema

UNSATISFIABLE = {
    "anyof-empty": ({"anyOf": []}, "anyOf is an empty list"),
    "required-forbidden": ({"type": "object", "required": ["x"], "additionalProperties": False},
                           "required property 'x' is forbidden"),
    "allof-contradiction": ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "have no value in common"),
}
EMPTY_FIRST_MASK = {"left-recursion": {"grammar": 'root ::= root "x"'}, "empty-class": {"regex": r"[^\s\S]"}}
#: xgrammar ignores uniqueItems, and this schema has only one other instance: the output is always [1,1].
FORCED_INVALID = {"type": "array", "items": {"const": 1}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
GOOD = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
#: A oneOf whose branches no instance satisfies together: enforced by both backends, so admitted.
DISJOINT_ONE_OF = next(c.schema for c in KEYWORD_CASES if c.key == "oneOf (disjoint branches)")
XGRAMMAR_UNENFORCED = [c for c in KEYWORD_CASES if MEASURED["xgrammar"][c.key] == NOT_ENFORCED]
CONFIG = dict(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=96)


def _request(rid, guide, **options):
    return {"id": rid, "prompt": "JSON:", "max_tokens": 24, "temperature": 1.0, "seed": 3,
            "structured_output": {**guide, **options}}


def _requests():
    out = [_request("good", {"json": GOOD}, json_whitespace="compact"),
           _request("disjoint-one-of", {"json": DISJOINT_ONE_OF}, json_whitespace="compact")]
    for case in XGRAMMAR_UNENFORCED:
        out.append(_request(f"strict:{case.key}", {"json": case.schema}))
        out.append(_request(f"best:{case.key}", {"json": case.schema}, strict=False, json_whitespace="compact"))
    for rid, (schema, _) in UNSATISFIABLE.items():
        out.append(_request(f"strict:{rid}", {"json": schema}))
        out.append(_request(f"best:{rid}", {"json": schema}, strict=False, json_whitespace="compact"))
    for rid, guide in EMPTY_FIRST_MASK.items():
        out.append(_request(f"strict:{rid}", guide))
        out.append(_request(f"best:{rid}", guide, strict=False))
    out.append(_request("best:forced-invalid", {"json": FORCED_INVALID}, strict=False, json_whitespace="compact"))
    return out


@pytest.fixture(scope="module")
def runs(tiny_model_path):
    """``{backend: {request id: output line}}`` for xgrammar, llguidance and auto."""
    requests = _requests()
    return {backend: {o["id"]: o for o in generate_on_group(
        TPGroup(), tiny_model_path, requests, EngineConfig(guided_backend=backend, **CONFIG), 24)}
        for backend in ("xgrammar", "llguidance", "auto")}


def _refused(out):
    return out["finish_reason"] == "error" and out["token_ids"] == [] and out["error"]


def _stop_outputs_validate(outputs, schemas):
    for rid, out in outputs.items():
        if out["finish_reason"] == "stop" and rid in schemas:
            import json

            assert validator_for_schema(schemas[rid]).is_valid(json.loads(out["text"])), out


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "auto"])
def test_good_request_runs_and_validates(runs, backend):
    out = runs[backend]["good"]
    assert out["finish_reason"] in ("stop", "length") and out["error"] is None, out
    assert out["guided_backend"] == ("xgrammar" if backend == "auto" else backend)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "auto"])
def test_disjoint_one_of_runs_and_a_stop_output_validates(runs, backend):
    out = runs[backend]["disjoint-one-of"]
    assert out["finish_reason"] in ("stop", "length") and out["error"] is None, out
    _stop_outputs_validate({"disjoint-one-of": out}, {"disjoint-one-of": DISJOINT_ONE_OF})


@pytest.mark.parametrize("case", XGRAMMAR_UNENFORCED, ids=lambda c: c.key)
def test_unenforced_keyword_is_refused_on_xgrammar_with_keyword_and_pointer(runs, case):
    out = runs["xgrammar"][f"strict:{case.key}"]
    assert _refused(out), out
    assert f"{case.key!r} is not enforced by xgrammar (at /" in out["error"]


@pytest.mark.parametrize("case", XGRAMMAR_UNENFORCED, ids=lambda c: c.key)
def test_auto_runs_unenforced_keyword_on_llguidance_or_refuses_with_both_reasons(runs, case):
    out = runs["auto"][f"strict:{case.key}"]
    if MEASURED["llguidance"][case.key] == ENFORCED:
        assert out["guided_backend"] == "llguidance" and out["finish_reason"] in ("stop", "length"), out
    else:
        assert _refused(out), out
        assert "no guided backend can guarantee" in out["error"]
        assert "xgrammar:" in out["error"] and "llguidance:" in out["error"]


@pytest.mark.parametrize("backend", ["xgrammar", "auto"])
def test_best_effort_runs_and_a_stop_output_always_validates(runs, backend):
    outputs = runs[backend]
    schemas = {f"best:{c.key}": c.schema for c in XGRAMMAR_UNENFORCED}
    for rid in schemas:
        out = outputs[rid]
        assert out["finish_reason"] in ("stop", "length", "error"), out
        if out["finish_reason"] == "error":
            assert out["error"].startswith("output"), out  # validation, not a refusal
    _stop_outputs_validate(outputs, schemas)


def test_llguidance_refuses_what_it_does_not_implement(runs):
    for case in XGRAMMAR_UNENFORCED:
        out = runs["llguidance"][f"strict:{case.key}"]
        if MEASURED["llguidance"][case.key] == NOT_ENFORCED:  # compiles, refused by admission
            assert _refused(out) and f"{case.key!r} is not enforced by llguidance" in out["error"], out
        elif MEASURED["llguidance"][case.key] != ENFORCED:
            assert _refused(out) and "llguidance cannot compile" in out["error"], out


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "auto"])
@pytest.mark.parametrize("name", list(UNSATISFIABLE))
def test_unsatisfiable_schema_is_refused_with_its_reason(runs, backend, name):
    out = runs[backend][f"strict:{name}"]
    assert _refused(out) and "no finite instance" in out["error"] and UNSATISFIABLE[name][1] in out["error"], out
    assert "at /" in out["error"]


@pytest.mark.parametrize("backend", ["xgrammar", "auto"])
@pytest.mark.parametrize("name", list(UNSATISFIABLE))
def test_unsatisfiable_schema_best_effort_is_an_error_not_a_stop(runs, backend, name):
    out = runs[backend][f"best:{name}"]
    assert out["guided_backend"] == "xgrammar", out
    # xgrammar ran it: no "stop" (validation turns an invalid end into an error); a string cut off is "length"
    assert out["finish_reason"] in ("error", "length"), out
    if out["finish_reason"] == "error":
        assert out["error"].startswith("output"), out


def test_unsatisfiable_schema_best_effort_on_llguidance_is_refused_by_the_backend(runs):
    for name in UNSATISFIABLE:
        out = runs["llguidance"][f"best:{name}"]
        assert _refused(out) and "llguidance cannot compile" in out["error"], out


@pytest.mark.parametrize("backend", ["xgrammar", "auto"])
def test_invalid_best_effort_output_keeps_text_and_tokens(runs, backend):
    out = runs[backend]["best:forced-invalid"]
    assert out["text"] == "[1,1]" and out["token_ids"], out
    assert out["finish_reason"] == "error" and "non-unique" in out["error"], out


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "auto"])
@pytest.mark.parametrize("name", list(EMPTY_FIRST_MASK))
def test_empty_first_mask_is_refused_at_admission(runs, backend, name):
    out = runs[backend][f"strict:{name}"]
    assert _refused(out), out
    assert "refused" in out["error"] and ("allows no token" in out["error"] or "first token" in out["error"]), out
    best = runs[backend][f"best:{name}"]
    assert best["finish_reason"] == "error" and best["finish_reason"] != "stop", best


def test_a_regex_check_that_backtracks_too_long_fails_closed(monkeypatch):
    """The last-line regex check of an output has a time limit: a near miss on nested alternatives errors out."""
    from tpguide.guided import schema_check
    from tpguide.guided.params import StructuredOutputsParams

    monkeypatch.setattr(schema_check, "REGEX_CHECK_TIMEOUT_S", 0.05)
    message = schema_check.validate_output(StructuredOutputsParams(regex="(a|aa)+c"), "a" * 60)
    assert message is not None and "could not be checked against its regex" in message, message
    assert schema_check.validate_output(StructuredOutputsParams(regex="(a|aa)+c"), "aaac") is None
