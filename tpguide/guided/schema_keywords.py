"""The keyword walk: every keyword a JSON schema uses, and those a backend does not enforce.

docs/architecture.md §5.  :func:`unenforced_keywords` reads each keyword
found by :func:`schema_keywords` against the measured table
(:data:`~tpguide.guided.enforcement.MEASURED`) and the rules no measurement
covers (a ``format`` nobody measured, ``$dynamicRef``, xgrammar's 32-bit
bounds and long enums, an unresolvable ``$ref``, a ``required`` name that
``properties`` does not declare).  Admission refuses what it finds
(:func:`~tpguide.guided.admission.check_enforceable`); the guide check and
the receipts report it.
"""

from __future__ import annotations

import json
from typing import Any, Iterator, List, Tuple

from tpguide.guided.enforcement import unenforced_keys
from tpguide.guided.keyword_cases import FORMAT_EXAMPLES, keyword_key
from tpguide.guided.schema_check import resolve_local_ref

__all__ = ["UNMEASURED_KEYWORDS", "XGRAMMAR_BOUND_LIMIT", "XGRAMMAR_ENUM_CHARS", "schema_keywords", "tag_schemas",
           "undeclared_required", "unenforced_keywords"]

#: Keywords whose value is one subschema / a list of subschemas / a name -> subschema map.
_SCHEMA_VALUED = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
                  "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_LIST_VALUED = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP_VALUED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")

#: Keywords nobody measured that change what validates: refused on every backend.
UNMEASURED_KEYWORDS = frozenset({"$dynamicRef", "$recursiveRef"})

#: Bounds xgrammar stores in 32 bits: at or above this it treats the bound as absent.
XGRAMMAR_BOUND_LIMIT = 2**31
#: The longest ``enum`` (characters of its JSON text) xgrammar gets: past about 100,000 its mask fill ran for
#: minutes inside ``CompactFSM::GetReachableStates`` (14,000 short values, or 4,000 of 45 characters; 10,000 short
#: ones took 0.5 s), blocking the engine loop; ``auto`` runs longer ones on llguidance (20,000 values: 1 s).
XGRAMMAR_ENUM_CHARS = 65536
_COUNT_BOUNDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def _escape(part: Any) -> str:
    return str(part).replace("~", "~0").replace("/", "~1")


def schema_keywords(schema: Any, pointer: str = "") -> Iterator[Tuple[str, str, Any, dict]]:
    """Every keyword of ``schema`` and its subschemas: ``(JSON pointer, keyword, value, the schema holding it)``.

    Values of ``const``, ``enum``, ``default`` and ``examples`` are data, not
    schemas, and are not entered.
    """
    if not isinstance(schema, dict):
        return
    for keyword, value in schema.items():
        here = f"{pointer}/{_escape(keyword)}"
        yield here, keyword, value, schema
        if keyword in _SCHEMA_VALUED and isinstance(value, dict):
            yield from schema_keywords(value, here)
        elif keyword in _LIST_VALUED and isinstance(value, list):
            for i, sub in enumerate(value):
                yield from schema_keywords(sub, f"{here}/{i}")
        elif keyword in _MAP_VALUED and isinstance(value, dict):
            for name, sub in value.items():
                yield from schema_keywords(sub, f"{here}/{_escape(name)}")


def unenforced_keywords(schema: Any, backend_name: str) -> List[Tuple[str, str]]:
    """``(JSON pointer, reason)`` for each use in ``schema`` of something ``backend_name`` does not enforce."""
    unenforced = unenforced_keys(backend_name)
    found = []
    for pointer, keyword, value, node in schema_keywords(schema):
        key = keyword_key(keyword, value, node, schema)
        if key in unenforced:
            found.append((pointer, f"{key!r} is not enforced by {backend_name}"))
        elif keyword == "format" and value not in FORMAT_EXAMPLES:
            found.append((pointer, f"format {value!r} is not enforced by any backend"))
        elif keyword in UNMEASURED_KEYWORDS:
            found.append((pointer, f"{keyword!r} is not enforced by any backend"))
        elif (backend_name == "xgrammar" and keyword in _COUNT_BOUNDS and isinstance(value, int)
              and value >= XGRAMMAR_BOUND_LIMIT):
            found.append((pointer, f"{keyword}={value} >= 2**31, which xgrammar treats as no bound"))
        elif (backend_name == "xgrammar" and keyword == "enum" and isinstance(value, list)
              and len(json.dumps(value)) > XGRAMMAR_ENUM_CHARS):
            found.append((pointer, f"an enum of {len(value)} values ({len(json.dumps(value))} characters of JSON) "
                                   f"is over xgrammar's {XGRAMMAR_ENUM_CHARS}: its mask fill can run for minutes"))
        elif keyword == "$ref" and isinstance(value, str) and resolve_local_ref(schema, value) is None:
            found.append((pointer, f"$ref {value!r} does not resolve inside the schema (only refs into this schema "
                                   f"are followed: '#/...' pointers, anchors, its own $id), so no backend can enforce what it names"))
        elif keyword == "required" and (undeclared := undeclared_required(node)):
            found.append((pointer, f"'required' names {undeclared} that 'properties' does not declare, and no "
                                   f"backend writes an undeclared property"))
    return found


def undeclared_required(node: dict) -> List[str]:
    """The names of an object schema's ``required`` that its own ``properties`` does not declare.

    Neither backend writes such a property, so the grammar lets the object
    close without it and the output fails validation afterwards (a typo:
    ``"propertieC"`` for ``"properties"``).  Only a node that is an object
    schema by itself (``type`` object, or ``properties``) is checked; a bare
    ``required`` inside ``allOf`` and the like is left to the keyword table.
    """
    required = node.get("required")
    kind = node.get("type")
    is_object = "properties" in node or kind == "object" or (isinstance(kind, list) and "object" in kind)
    if not is_object or not isinstance(required, list):
        return []
    declared = node.get("properties")
    declared = declared if isinstance(declared, dict) else {}
    return [name for name in required if isinstance(name, str) and name not in declared]



def tag_schemas(node: Any, pointer: str = "") -> Iterator[Tuple[str, Any]]:
    """``(JSON pointer, schema)`` of every ``{"type": "json_schema", "json_schema": ...}`` inside a structural tag."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and isinstance(node.get("json_schema"), dict):
            yield f"{pointer}/json_schema", node["json_schema"]
            return
        for key, value in node.items():
            yield from tag_schemas(value, f"{pointer}/{_escape(key)}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from tag_schemas(value, f"{pointer}/{i}")
