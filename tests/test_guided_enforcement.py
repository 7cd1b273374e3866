"""The per-backend keyword enforcement table: sound cases, re-measured, printed in docs/guarantees.md.

``python -m pytest -q tests/test_guided_enforcement.py -k table -s`` prints the table.
"""

import copy
import json
from pathlib import Path

import pytest

from tpguide.guided.admission import GuideRefused, check_enforceable
from tpguide.guided.enforcement import MEASURED, NOT_ENFORCED, TABLE_BACKENDS, format_table, measure_backend
from tpguide.guided.keyword_cases import KEYWORD_CASES, keyword_key
from tpguide.guided.params import StructuredOutputsParams
from tpguide.guided.schema_check import validator_for_schema
from tpguide.guided.schema_keywords import unenforced_keywords

GUARANTEES = Path(__file__).resolve().parents[1] / "docs" / "guarantees.md"


def _without(schema: dict, key: str) -> dict:
    """``schema`` without the keyword that ``key`` names (at the top level)."""
    out = copy.deepcopy(schema)
    for keyword, value in schema.items():
        if keyword_key(keyword, value, schema) == key:
            del out[keyword]
    return out


@pytest.mark.parametrize("case", KEYWORD_CASES, ids=lambda c: c.key)
def test_each_case_violates_only_its_keyword(case):
    validator = validator_for_schema(case.schema)
    assert validator.is_valid(case.valid)
    assert not validator.is_valid(case.invalid)
    relaxed = _without(case.schema, case.key)
    if relaxed != case.schema and case.key != "definitions":  # (a $ref into removed definitions dangles)
        assert validator_for_schema(relaxed).is_valid(case.invalid), relaxed


@pytest.mark.parametrize("name", TABLE_BACKENDS)
def test_table_is_what_the_installed_backend_enforces(name, tokenizer):
    from guided_testing import load_test_backend

    measured = measure_backend(load_test_backend(name, 49152), tokenizer)
    if measured != MEASURED[name]:
        changed = {k: (MEASURED[name][k], v) for k, v in measured.items() if MEASURED[name][k] != v}
        pytest.fail(f"{name} enforces differently from the checked-in table, (was, now): {changed}; "
                    "update _EXCEPTIONS in tpguide/guided/enforcement.py and the table in docs/guarantees.md")


def test_guarantees_page_prints_the_table():
    table = format_table(MEASURED)
    print("\n" + table)
    assert table in GUARANTEES.read_text(encoding="utf-8")


def test_refusal_names_keyword_and_pointer():
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True}},
              "$defs": {"x": {"type": "integer", "not": {"const": 1}}}}
    with pytest.raises(GuideRefused) as info:
        check_enforceable(StructuredOutputsParams(json=schema), "xgrammar")
    message = str(info.value)
    assert "'uniqueItems' is not enforced by xgrammar (at /properties/tags/uniqueItems)" in message
    assert "'not' is not enforced by xgrammar (at /$defs/x/not)" in message
    assert '"strict": false' in message
    check_enforceable(StructuredOutputsParams(json=schema, strict=False), "xgrammar")  # best effort: no check


def test_each_unenforced_key_is_found_by_admission():
    for name in TABLE_BACKENDS:
        for case in KEYWORD_CASES:
            found = [why for _, why in unenforced_keywords(case.schema, name)]
            if MEASURED[name][case.key] == NOT_ENFORCED:
                assert any(repr(case.key) in why for why in found), (name, case.key, found)


def test_unmeasured_format_and_huge_bounds_are_refused():
    found = unenforced_keywords({"type": "string", "format": "phone"}, "llguidance")
    assert found == [("/format", "format 'phone' is not enforced by any backend")]
    found = unenforced_keywords({"type": "array", "maxItems": 2**31}, "xgrammar")
    assert found == [("/maxItems", "maxItems=2147483648 >= 2**31, which xgrammar treats as no bound")]
    assert unenforced_keywords({"type": "array", "maxItems": 2**31}, "llguidance") == []
    # data is not schema: a const holding keyword names is fine
    assert unenforced_keywords({"const": {"uniqueItems": True, "format": "phone"}}, "xgrammar") == []


def test_json_pointer_escapes():
    schema = {"type": "object", "properties": {"a/b~c": {"type": "array", "contains": {"const": 1}}}}
    assert unenforced_keywords(schema, "xgrammar") == [
        ("/properties/a~1b~0c/contains", "'contains' is not enforced by xgrammar")]


def test_table_is_json_serialisable_and_complete():
    assert set(MEASURED) == set(TABLE_BACKENDS)
    for table in MEASURED.values():
        assert list(table) == [c.key for c in KEYWORD_CASES]
    json.dumps(MEASURED)
