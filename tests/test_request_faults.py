"""A fault in one request's own work fails that request alone (tp 1, in process); text checks at the door.

``TPGUIDE_REQUEST_FAULT`` (tpguide/engine/request_faults.py) raises in the
driver's work for the request whose prompt holds the marker: admitting it,
giving it a matcher, finishing its step, building its output.  That request
ends ``"error"`` with ``server_fault`` set and the exception named; every
other request's output equals a run without the fault, bit for bit.  A fault
of the step itself still ends the engine's ``generate`` (the server turns
that into an exit, tests/test_serving_faults.py).
"""

import json

import pytest

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine
from tpguide.engine.request_faults import REQUEST_FAULT_ENV, InjectedFault
from tpguide.engine.request_io import parse_request_lines
from tpguide.engine.text_check import MAX_JSON_DEPTH, check_unicode, find_invalid_text
from tpguide.guided.admission import GuideRefused, check_enforceable
from tpguide.guided.params import StructuredOutputsParams
from tpguide.guided.schema_keywords import unenforced_keywords

CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
MARKER = "FAULT-HERE"
REQUESTS = [
    {"id": "free", "prompt": "Once upon a time", "max_tokens": 6},
    {"id": "faulty", "prompt": f"JSON {MARKER}:", "max_tokens": 8,
     "structured_output": {"json": {"type": "object", "properties": {"n": {"type": "integer"}}}}},
    {"id": "schema", "prompt": "JSON:", "max_tokens": 8,
     "structured_output": {"json": {"type": "object", "properties": {"s": {"type": "string"}}}}},
]


def run(model_path):
    engine = build_engine(TPGroup(), model_path, CONFIG)
    try:
        outputs = engine.generate(parse_request_lines([json.dumps(r) for r in REQUESTS], 8))
    finally:
        engine.shutdown()
    return {o.id: o.to_json() for o in outputs}


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    return run(tiny_model_path)


@pytest.mark.parametrize("phase", ["admit", "schedule", "finish", "output"])
def test_a_fault_fails_its_request_alone(tiny_model_path, reference, monkeypatch, phase):
    monkeypatch.setenv(REQUEST_FAULT_ENV, f"{phase}:{MARKER}")
    outputs = run(tiny_model_path)
    faulty = outputs["faulty"]
    assert faulty["finish_reason"] == "error" and faulty["server_fault"] is True, faulty
    assert f"InjectedFault: {REQUEST_FAULT_ENV}: {phase} fault for request 'faulty'" in faulty["error"], faulty
    if phase != "output":  # output: generated to the end, then its output could not be built
        assert len(faulty["token_ids"]) < len(reference["faulty"]["token_ids"])
    for rid in ("free", "schema"):
        assert outputs[rid] == reference[rid]


def test_a_fault_of_the_step_itself_still_ends_generate(tiny_model_path, monkeypatch):
    monkeypatch.setenv(REQUEST_FAULT_ENV, f"step:{MARKER}")
    with pytest.raises(InjectedFault):
        run(tiny_model_path)


@pytest.mark.parametrize("body, where", [
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ({"prompt": "ok", "stop": ["a", "b\udc00"]}, "stop[1]"),
    ({"tools": [{"type": "function", "function": {"name": "get_\udbff"}}]}, "tools[0].function.name"),
    ({"response_format": {"json_schema": {"schema": {"properties": {"x\ud83d": {}}}}}},
     "a key of response_format.json_schema.schema.properties"),
    ({"logit_bias": {"\udfff": 1}}, "a key of logit_bias"),
])
def test_lone_surrogates_are_found_with_their_field(body, where):
    message = find_invalid_text(body)
    assert message is not None and message.startswith(where + " is not valid Unicode (lone surrogate U+"), message
    with pytest.raises(ValueError, match="lone surrogate"):
        check_unicode(body)


def test_valid_text_passes_and_deep_nesting_is_refused():
    assert find_invalid_text({"a": ["héllo 😀 \u200f\u0301 \x00", {"ü": "ok"}]}) is None
    deep = inner = {}
    for _ in range(MAX_JSON_DEPTH + 2):
        inner["x"] = {}
        inner = inner["x"]
    assert "nested more than" in find_invalid_text({"schema": deep})


def test_an_offline_line_with_a_lone_surrogate_fails_alone():
    lines = [json.dumps({"id": "bad", "messages": [{"role": "user", "content": "\ud800"}]}),
             json.dumps({"id": "good", "prompt": "Hi"})]
    bad, good = parse_request_lines(lines, 4)
    assert bad.finish_reason == "error" and "messages[0].content is not valid Unicode" in bad.error
    assert not good.is_finished


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_required_names_missing_from_properties_are_refused_with_a_pointer(backend):
    typo = {"type": "object", "propertieC": {"name": {"type": "string"}}, "required": ["name"]}
    params = StructuredOutputsParams(json=typo)
    with pytest.raises(GuideRefused, match=r"'required' names \['name'\] .*\(at /required\)"):
        check_enforceable(params, backend)
    nested = {"type": "object", "properties": {"p": {"type": "object", "properties": {"a": {}},
                                                     "required": ["a", "b"]}}}
    with pytest.raises(GuideRefused, match=r"\['b'\] .*\(at /properties/p/required\)"):
        check_enforceable(StructuredOutputsParams(json=nested), backend)
    fine = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    check_enforceable(StructuredOutputsParams(json=fine), backend)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_ref_that_does_not_resolve_is_refused_and_same_document_refs_pass(backend):
    remote = {"type": "object", "properties": {"a": {"$ref": "http://example.com/x.json"}}, "required": ["a"]}
    with pytest.raises(GuideRefused, match=r"\$ref 'http://example.com/x.json' does not resolve .*/properties/a/\$ref"):
        check_enforceable(StructuredOutputsParams(json=remote), backend)
    dangling = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "$defs": {}}
    with pytest.raises(GuideRefused, match="does not resolve"):
        check_enforceable(StructuredOutputsParams(json=dangling), backend)
    local = {"$id": "https://example.com/p.json", "$defs": {"s": {"type": "string"}},
             "type": "object", "properties": {"a": {"$ref": "#/$defs/s"}, "b": {"$ref": "https://example.com/p.json#/$defs/s"},
                                              "c": {"$ref": "#"}}}
    assert [w for _, w in unenforced_keywords(local, backend) if "$ref" in w] == []


def test_a_long_enum_goes_to_llguidance_not_to_xgrammar():
    """A 14,000-value enum made xgrammar's mask fill run for minutes, blocking the engine loop (a trial)."""
    schema = {"enum": [f"v{i}" for i in range(14000)]}
    (pointer, why), = unenforced_keywords(schema, "xgrammar")
    assert pointer == "/enum" and "an enum of 14000 values" in why and "over xgrammar's 65536" in why
    assert unenforced_keywords(schema, "llguidance") == []
    assert unenforced_keywords({"enum": [f"v{i}" for i in range(5000)]}, "xgrammar") == []


def test_tool_parameters_invalid_against_the_metaschema_are_a_400_naming_the_tool():
    from tpguide.serving.errors import APIError
    from tpguide.serving.tool_calls import parse_tools

    with pytest.raises(APIError) as info:
        parse_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "integer",
                                                                                  "maxLength": -1}}}])
    assert info.value.status == 400 and info.value.param == "tools[0].function.parameters"
    assert "-1 is less than the minimum of 0 (at /maxLength)" in info.value.message
