"""Pure reliability pieces: output streaming/resume, the finite-instance schema check, fault specs."""

import json

import pytest

from tpguide.dist.fault_inject import parse_fault_spec
from tpguide.engine.request import RequestOutput
from tpguide.engine.request_io import PartialWriter, load_finished, partial_path
from tpguide.guided.params import StructuredOutputsParams
from tpguide.guided.schema_check import check_schema_has_finite_instance


def out(rid, reason="stop"):
    return RequestOutput(request_id=rid, text="t", token_ids=[1], finish_reason=reason,
                         error="boom" if reason == "error" else None)


def test_partial_lines_survive_and_resume_reads_both_files(tmp_path):
    final = tmp_path / "out.jsonl"
    final.write_text(json.dumps(out("a").to_json()) + "\n")
    writer = PartialWriter(partial_path(str(final)))
    writer(out("b"))
    writer(out("c", "error"))
    with open(partial_path(str(final)), "a") as f:
        f.write('{"id": "d", "text": "tor')  # a crash mid-write
    done = load_finished(str(final))
    assert sorted(done) == ["a", "b", "c"]  # the torn line reruns
    assert sorted(load_finished(str(final), retry_errors=True)) == ["a", "b"]
    assert RequestOutput.from_json(done["c"]) == out("c", "error")
    writer.close(remove=True)
    assert not (tmp_path / "out.jsonl.partial").exists()


def test_partial_writer_starts_empty_unless_appending(tmp_path):
    path = str(tmp_path / "o.partial")
    PartialWriter(path)(out("a"))
    PartialWriter(path, append=True)(out("b"))
    assert [json.loads(x)["id"] for x in open(path)] == ["a", "b"]
    PartialWriter(path).close()
    assert open(path).read() == ""


@pytest.mark.parametrize("schema", [
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    {"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]},
    {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    {"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "array", "prefixItems": [{"$ref": "#"}],
                                                       "minItems": 1}}},
    {"type": "object", "properties": {"a": False}, "required": ["a"]},
])
def test_schemas_without_finite_instance_are_rejected(schema):
    with pytest.raises(ValueError, match="no finite instance"):
        check_schema_has_finite_instance(schema)
    with pytest.raises(ValueError, match="no finite instance"):
        StructuredOutputsParams(json=schema)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"next": {"$ref": "#"}}},  # optional recursion: {} ends it
    {"type": "array", "items": {"$ref": "#"}},  # [] ends it
    {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#"}, "minItems": 1}]},
    {"$defs": {"t": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}},
                     "required": ["kids"]}}, "$ref": "#/$defs/t"},
    {"$ref": "https://example.com/elsewhere.json"},  # unknown: assumed fine
    {"type": "string"}, True, {},
])
def test_schemas_with_a_base_case_pass(schema):
    check_schema_has_finite_instance(schema)


def test_fault_spec():
    assert parse_fault_spec("1:3, 0:7") == [(1, 3), (0, 7)]
    assert parse_fault_spec("") == []
    for bad in ("1", "a:b", "1:0", "-1:2"):
        with pytest.raises(ValueError, match="TPGUIDE_FAULT_INJECT"):
            parse_fault_spec(bad)
