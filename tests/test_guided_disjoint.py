"""Disjoint ``oneOf`` branches (tpguide.guided.disjoint): sound against jsonschema, and what admission makes of it."""

import itertools

import pytest

from tpguide.guided.admission import GuideRefused, check_enforceable
from tpguide.guided.disjoint import one_of_branches_disjoint
from tpguide.guided.params import StructuredOutputsParams
from tpguide.guided.schema_check import validator_for_schema
from tpguide.guided.schema_keywords import unenforced_keywords

_INT, _STR = {"type": "integer"}, {"type": "string"}
KIND_A = {"type": "object", "properties": {"kind": {"const": "a"}, "x": _INT}, "required": ["kind"]}
KIND_B = {"type": "object", "properties": {"kind": {"enum": ["b", "c"]}, "y": _STR}, "required": ["kind", "y"]}

DISJOINT = [
    [_INT, _STR],
    [{"type": "null"}, {"type": ["string", "boolean"]}, {"type": "array"}],
    [{"const": 1}, {"const": 2}, {"const": True}],  # true is not 1 in JSON Schema
    [{"enum": ["a", "b"]}, {"enum": ["c"]}, {"type": "number", "minimum": 3}],
    [KIND_A, KIND_B],
    [{"type": "object", "required": ["a"]},
     {"type": "object", "properties": {"b": _INT}, "additionalProperties": False}],
    [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}],
    [{"type": "integer"}, False, {"type": "string"}],
    [{"type": "object", "properties": {"v": {"type": "object", "properties": {"t": {"const": 1}},
                                             "required": ["t"]}}, "required": ["v"]},
     {"type": "object", "properties": {"v": {"type": "object", "properties": {"t": {"const": 2}},
                                             "required": ["t"]}}, "required": ["v"]}],
]
OVERLAPPING = [
    [{"type": "integer"}, {"type": "number"}],  # 2 is both
    [{"const": 1}, {"const": 1.0}],
    [{"required": ["kind"], "properties": {"kind": {"const": "a"}}},  # no type: any string satisfies both
     {"required": ["kind"], "properties": {"kind": {"const": "b"}}}],
    [{"type": "object", "properties": {"kind": {"const": "a"}}},  # kind not required: {} satisfies both
     {"type": "object", "properties": {"kind": {"const": "b"}}}],
    [_INT, True],
    [{"$ref": "#/$defs/missing"}, _STR],
    [{"minimum": 3}, {"maximum": 5}],  # undecided (4): counted as overlapping
]
ROOT = {"$defs": {"a": {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                  "b": {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}}}

#: Values to look for a witness that two "disjoint" branches overlap.
POOL = [None, True, False, 0, 1, 1.0, 2, 2.5, 3, 4, -1, "", "a", "b", "c", [], [1], {}, {"a": 1}, {"b": 1},
        {"kind": "a"}, {"kind": "b", "y": 0}, {"kind": "c", "y": 1, "x": 2}, {"k": "a"}, {"k": "b"},
        {"v": {"t": 1}}, {"v": {"t": 2}}, {"a": 1, "b": 2}]


@pytest.mark.parametrize("branches", DISJOINT, ids=range(len(DISJOINT)))
def test_disjoint_branches_share_no_instance(branches):
    assert one_of_branches_disjoint(branches, ROOT)
    validators = [validator_for_schema({**ROOT, **b}) if isinstance(b, dict) else validator_for_schema(b)
                  for b in branches]
    for value in POOL:
        matching = [i for i, v in enumerate(validators) if v.is_valid(value)]
        assert len(matching) <= 1, (value, matching)


@pytest.mark.parametrize("branches", OVERLAPPING, ids=range(len(OVERLAPPING)))
def test_branches_not_proved_disjoint(branches):
    assert not one_of_branches_disjoint(branches, ROOT)


def test_overlapping_cases_really_overlap_where_the_pool_shows_it():
    witnessed = 0
    for branches in OVERLAPPING:
        if {"$ref": "#/$defs/missing"} in branches:
            continue  # a $ref to nothing is undecidable here (jsonschema cannot even validate it)
        validators = [validator_for_schema({**ROOT, **b}) if isinstance(b, dict) else validator_for_schema(b)
                      for b in branches]
        witnessed += any(sum(v.is_valid(x) for v in validators) >= 2 for x in POOL)
    assert witnessed == len(OVERLAPPING) - 1  # every case but the dangling $ref has a witness in the pool


def test_admission_allows_a_disjoint_one_of_and_refuses_the_rest():
    for backend in ("xgrammar", "llguidance"):
        disjoint = {"type": "object", "properties": {"shape": {"oneOf": [KIND_A, KIND_B]}}}
        assert unenforced_keywords(disjoint, backend) == [], backend
        nested = {"$defs": ROOT["$defs"], "oneOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}]}
        assert unenforced_keywords(nested, backend) == [], backend  # $ref resolved against the whole schema
        overlapping = {"oneOf": [_INT, {"type": "number"}]}
        assert unenforced_keywords(overlapping, backend) == [("/oneOf", f"'oneOf' is not enforced by {backend}")]
        with pytest.raises(GuideRefused, match="a oneOf is enforced only where its branches are proved disjoint"):
            check_enforceable(StructuredOutputsParams(json=overlapping), backend)


def test_pairs_are_all_checked():
    # three branches: 0-1 and 1-2 disjoint, 0-2 overlapping
    branches = [{"const": 1}, {"const": "x"}, {"type": "integer"}]
    assert not one_of_branches_disjoint(branches)
    assert all(one_of_branches_disjoint(list(p)) for p in itertools.combinations(branches[:2], 2))
