"""One test case per JSON Schema validation keyword: schema, a valid and an invalid instance.

:data:`KEYWORD_CASES` drives the measurement of what each grammar backend
enforces (:mod:`tpguide.guided.enforcement`).  Every case is a schema that
uses its keyword, an instance that satisfies the schema, and an instance that
violates *only* that keyword: removing the keyword makes the invalid instance
valid (``tests/test_guided_enforcement.py`` checks all three facts with
``jsonschema``).  A backend whose matcher accepts the invalid instance does not
enforce the keyword.

The keys are what :func:`keyword_key` returns for a keyword in a schema, so the
admission check (:mod:`tpguide.guided.admission`) looks schemas up in the same
table.  Spellings covered: JSON Schema 2020-12 (``$defs``, ``prefixItems``,
``dependentRequired``, ...), draft-07 (``definitions``, array ``items`` with
``additionalItems``, ``dependencies``), draft-04's boolean
``exclusiveMinimum``/``exclusiveMaximum``, and the common ``format`` values.
Instances list properties in schema order (xgrammar's default order).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tpguide.guided.disjoint import one_of_branches_disjoint

#: A look-ahead or look-behind group in a regex (``(?=``, ``(?!``, ``(?<=``, ``(?<!``).
LOOKAROUND = re.compile(r"\(\?<?[=!]")


@dataclass(frozen=True)
class KeywordCase:
    """A keyword, the schema using it, and instances that satisfy / violate only it.

    Attributes
    ----------
    key : str
        Table key, as :func:`keyword_key` names the keyword (``"minLength"``,
        ``"items (array, draft-07)"``, ``"format: email"``).
    dialect : str
        ``"2020-12"``, ``"draft-07"``, ``"draft-04"`` or ``"format"``.
    schema : dict
    valid : object
        Satisfies ``schema``.
    invalid : object
        Violates ``schema`` only through ``key``.
    """

    key: str
    dialect: str
    schema: dict
    valid: Any
    invalid: Any


def _obj(props: dict, **extra: Any) -> dict:
    return {"type": "object", "properties": props, **extra}


_INT, _STR = {"type": "integer"}, {"type": "string"}

_CASES_2020 = [
    KeywordCase("type", "2020-12", {"type": "integer"}, 3, "3"),
    KeywordCase("enum", "2020-12", {"type": "integer", "enum": [1, 2]}, 2, 3),
    KeywordCase("const", "2020-12", {"type": "integer", "const": 7}, 7, 8),
    KeywordCase("multipleOf", "2020-12", {"type": "integer", "multipleOf": 5}, 15, 7),
    KeywordCase("maximum", "2020-12", {"type": "integer", "maximum": 10}, 10, 11),
    KeywordCase("exclusiveMaximum", "2020-12", {"type": "integer", "exclusiveMaximum": 10}, 9, 10),
    KeywordCase("minimum", "2020-12", {"type": "integer", "minimum": 10}, 10, 9),
    KeywordCase("exclusiveMinimum", "2020-12", {"type": "integer", "exclusiveMinimum": 10}, 11, 10),
    KeywordCase("maximum (number)", "2020-12", {"type": "number", "maximum": 1.5}, 1.25, 1.75),
    KeywordCase("minimum (number)", "2020-12", {"type": "number", "minimum": 1.5}, 1.75, 1.25),
    KeywordCase("multipleOf (number)", "2020-12", {"type": "number", "multipleOf": 0.5}, 1.5, 1.25),
    KeywordCase("maxLength", "2020-12", {"type": "string", "maxLength": 3}, "abc", "abcd"),
    KeywordCase("minLength", "2020-12", {"type": "string", "minLength": 3}, "abc", "ab"),
    KeywordCase("maxLength (with pattern)", "2020-12",
                {"type": "string", "pattern": "^[a-c]+$", "maxLength": 3}, "abc", "abca"),
    KeywordCase("minLength (with pattern)", "2020-12",
                {"type": "string", "pattern": "^[a-c]+$", "minLength": 3}, "abc", "ab"),
    KeywordCase("maxLength (with format)", "2020-12",
                {"type": "string", "format": "email", "maxLength": 7}, "a@b.org", "ab@b.org"),
    KeywordCase("pattern", "2020-12", {"type": "string", "pattern": "^[a-c]+$"}, "abc", "abd"),
    KeywordCase("pattern (lookaround)", "2020-12",
                {"type": "string", "pattern": "^(?=.*[0-9])[a-z0-9]+$"}, "a1", "ab"),
    KeywordCase("maxItems", "2020-12", {"type": "array", "items": _INT, "maxItems": 2}, [1, 2], [1, 2, 3]),
    KeywordCase("minItems", "2020-12", {"type": "array", "items": _INT, "minItems": 2}, [1, 2], [1]),
    KeywordCase("uniqueItems", "2020-12", {"type": "array", "items": _INT, "uniqueItems": True}, [1, 2], [1, 1]),
    KeywordCase("contains", "2020-12", {"type": "array", "items": _INT, "contains": {"const": 5}}, [1, 5], [1, 2]),
    KeywordCase("maxContains", "2020-12",
                {"type": "array", "items": _INT, "contains": {"const": 5}, "maxContains": 1}, [5, 1], [5, 5]),
    KeywordCase("minContains", "2020-12",
                {"type": "array", "items": _INT, "contains": {"const": 5}, "minContains": 2}, [5, 5], [5, 1]),
    KeywordCase("maxProperties", "2020-12",
                _obj({"a": _INT, "b": _INT}, maxProperties=1), {"a": 1}, {"a": 1, "b": 2}),
    KeywordCase("minProperties", "2020-12",
                _obj({"a": _INT, "b": _INT}, minProperties=2), {"a": 1, "b": 2}, {"a": 1}),
    KeywordCase("required", "2020-12", _obj({"a": _INT, "b": _INT}, required=["b"]), {"b": 2}, {"a": 1}),
    KeywordCase("dependentRequired", "2020-12",
                _obj({"a": _INT, "b": _INT}, dependentRequired={"a": ["b"]}), {"a": 1, "b": 2}, {"a": 1}),
    KeywordCase("dependentSchemas", "2020-12",
                _obj({"a": _INT, "b": _INT}, dependentSchemas={"a": {"required": ["b"]}}),
                {"a": 1, "b": 2}, {"a": 1}),
    KeywordCase("properties", "2020-12", _obj({"a": _INT}), {"a": 1}, {"a": "x"}),
    KeywordCase("patternProperties", "2020-12",
                {"type": "object", "patternProperties": {"^n_": _INT}}, {"n_a": 1}, {"n_a": "x"}),
    KeywordCase("additionalProperties", "2020-12",
                _obj({"a": _INT}, additionalProperties=False), {"a": 1}, {"a": 1, "b": 2}),
    KeywordCase("additionalProperties (schema)", "2020-12",
                _obj({"a": _INT}, additionalProperties=_INT), {"a": 1, "b": 2}, {"a": 1, "b": "x"}),
    KeywordCase("propertyNames", "2020-12",
                {"type": "object", "additionalProperties": _INT, "propertyNames": {"pattern": "^[a-c]+$"}},
                {"ab": 1}, {"ad": 1}),
    KeywordCase("unevaluatedProperties", "2020-12",
                {"type": "object", "allOf": [{"properties": {"a": _INT}}], "unevaluatedProperties": False},
                {"a": 1}, {"a": 1, "b": 2}),
    KeywordCase("items", "2020-12", {"type": "array", "items": _INT}, [1, 2], [1, "x"]),
    KeywordCase("prefixItems", "2020-12",
                {"type": "array", "prefixItems": [_INT, _STR]}, [1, "x"], [1, 2]),
    KeywordCase("items (after prefixItems)", "2020-12",
                {"type": "array", "prefixItems": [_INT], "items": False}, [1], [1, 2]),
    KeywordCase("unevaluatedItems", "2020-12",
                {"type": "array", "prefixItems": [_INT], "unevaluatedItems": False}, [1], [1, 2]),
    KeywordCase("allOf", "2020-12", {"type": "integer", "allOf": [{"minimum": 1}, {"maximum": 5}]}, 3, 7),
    KeywordCase("anyOf", "2020-12", {"anyOf": [_INT, {"type": "boolean"}]}, True, "x"),
    KeywordCase("oneOf", "2020-12", {"oneOf": [{"type": "integer"}, {"type": "number"}]}, 1.5, 2),
    KeywordCase("oneOf (disjoint branches)", "2020-12",
                {"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}}, "required": ["kind"]},
                           {"type": "object", "properties": {"kind": {"const": "b"}, "n": _INT},
                            "required": ["kind", "n"]}]},
                {"kind": "b", "n": 1}, {"kind": "c"}),
    KeywordCase("not", "2020-12", {"type": "integer", "not": {"const": 3}}, 4, 3),
    KeywordCase("if/then/else", "2020-12",
                {"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 2}, "else": {"maximum": 5}},
                12, 13),
    KeywordCase("$ref", "2020-12",
                {"$defs": {"small": {"type": "integer", "maximum": 5}}, "$ref": "#/$defs/small"}, 5, 6),
    KeywordCase("$anchor", "2020-12",
                {"$defs": {"small": {"$anchor": "small", "type": "integer", "maximum": 5}},
                 "$ref": "#small"}, 5, 6),
]

_CASES_DRAFT07 = [
    KeywordCase("definitions", "draft-07",
                {"definitions": {"small": {"type": "integer", "maximum": 5}}, "$ref": "#/definitions/small"}, 5, 6),
    KeywordCase("items (array, draft-07)", "draft-07",
                {"type": "array", "items": [_INT, _STR]}, [1, "x"], [1, 2]),
    KeywordCase("additionalItems", "draft-07",
                {"type": "array", "items": [_INT], "additionalItems": False}, [1], [1, 2]),
    KeywordCase("dependencies (array)", "draft-07",
                _obj({"a": _INT, "b": _INT}, dependencies={"a": ["b"]}), {"a": 1, "b": 2}, {"a": 1}),
    KeywordCase("dependencies (schema)", "draft-07",
                _obj({"a": _INT, "b": _INT}, dependencies={"a": {"required": ["b"]}}), {"a": 1, "b": 2}, {"a": 1}),
]

_CASES_DRAFT04 = [
    KeywordCase("exclusiveMaximum (boolean, draft-04)", "draft-04",
                {"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer",
                 "maximum": 10, "exclusiveMaximum": True}, 9, 10),
    KeywordCase("exclusiveMinimum (boolean, draft-04)", "draft-04",
                {"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer",
                 "minimum": 10, "exclusiveMinimum": True}, 11, 10),
]

#: ``format`` values with a valid and an invalid string (jsonschema's format checkers agree).
FORMAT_EXAMPLES = {
    "date-time": ("2024-05-01T12:30:00Z", "2024-05-01 noon"),
    "date": ("2024-05-01", "2024-13-01"),
    "time": ("12:30:00Z", "25:30:00Z"),
    "duration": ("P3D", "3 days"),
    "email": ("a@b.org", "ab.org"),
    "idn-email": ("a@b.org", "ab.org"),
    "hostname": ("example.org", "-bad-.org"),
    "idn-hostname": ("example.org", "-bad-.org"),
    "ipv4": ("10.0.0.1", "10.0.0.300"),
    "ipv6": ("::1", "::g"),
    "uri": ("https://example.org/a", "not a uri"),
    "uri-reference": ("/a/b", "\\\\bad"),
    "iri": ("https://example.org/a", "not an iri"),
    "uri-template": ("https://example.org/{id}", "https://example.org/{id"),
    "uuid": ("123e4567-e89b-12d3-a456-426614174000", "123e4567"),
    "json-pointer": ("/a/b", "a/b"),
    "relative-json-pointer": ("0/a", "/a"),
    "regex": ("^a+$", "(a"),
}

_CASES_FORMAT = [
    KeywordCase(f"format: {name}", "format", {"type": "string", "format": name}, valid, invalid)
    for name, (valid, invalid) in FORMAT_EXAMPLES.items()
]

#: Every case, in table order.
KEYWORD_CASES: tuple = tuple(_CASES_2020 + _CASES_DRAFT07 + _CASES_DRAFT04 + _CASES_FORMAT)


def keyword_key(keyword: str, value: Any, schema: dict, root: Any = None) -> str:
    """The :data:`KEYWORD_CASES` key of ``keyword`` with ``value`` in the (sub)schema ``schema``.

    Distinguishes the spellings and forms the backends treat differently:
    array vs schema ``items``, ``items`` after ``prefixItems``, boolean
    ``exclusiveMinimum``, array vs schema ``dependencies``, each ``format``,
    numeric bounds and ``multipleOf`` on ``number`` vs ``integer``, length
    bounds beside a ``pattern`` or ``format``, a ``pattern`` with look-around, schema vs boolean
    ``additionalProperties``, a ``oneOf`` whose branches no instance can
    satisfy together (:mod:`tpguide.guided.disjoint`; ``root``, the whole
    schema, resolves their ``$ref``).  Other keywords map to themselves;
    ``then`` and ``else`` map to ``"if/then/else"``.
    """
    if keyword == "format":
        return f"format: {value}"
    if keyword == "items":
        if isinstance(value, list):
            return "items (array, draft-07)"
        return "items (after prefixItems)" if "prefixItems" in schema else "items"
    if keyword in ("exclusiveMaximum", "exclusiveMinimum") and isinstance(value, bool):
        return f"{keyword} (boolean, draft-04)"
    if keyword == "dependencies" and isinstance(value, dict):
        forms = {"array" if isinstance(v, list) else "schema" for v in value.values()}
        return f"dependencies ({'array' if forms == {'array'} else 'schema'})"
    if keyword in ("maximum", "minimum", "multipleOf") and schema.get("type") == "number":
        return f"{keyword} (number)"
    if keyword == "pattern" and isinstance(value, str) and LOOKAROUND.search(value):
        return "pattern (lookaround)"
    if keyword in ("minLength", "maxLength") and "pattern" in schema:
        return f"{keyword} (with pattern)"
    if keyword == "maxLength" and "format" in schema:
        return "maxLength (with format)"
    if keyword == "additionalProperties" and isinstance(value, dict):
        return "additionalProperties (schema)"
    if keyword in ("if", "then", "else"):
        return "if/then/else"
    if keyword == "oneOf" and one_of_branches_disjoint(value, schema if root is None else root):
        return "oneOf (disjoint branches)"
    return keyword
