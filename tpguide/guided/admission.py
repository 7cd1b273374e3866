"""Admitting a guide: checked fail closed against one backend, then compiled (:func:`admit`).

docs/architecture.md §5.  The backends are built by
:func:`~tpguide.guided.backends.make_backend`; ``--guided-backend auto`` runs
:func:`admit` per backend (:class:`~tpguide.guided.auto_backend.AutoBackend`).
The driver runs :func:`admit` off the step loop
(:mod:`tpguide.guided.compile_service`).

**Fail closed: refuse what the chosen backend cannot guarantee.**  An output
that finishes ``"stop"`` satisfies its constraint, so a request is refused up front (``finish_reason="error"``, a
400 in the server) when:

* its schema uses a keyword the backend does not enforce
  (:data:`~tpguide.guided.enforcement.MEASURED`; a ``format`` nobody measured
  counts as unenforced; xgrammar turns length/count bounds >= 2**31 into
  "unbounded"), :func:`check_enforceable`;
* an object's ``required`` names a property its ``properties`` does not
  declare (neither backend writes one), :func:`undeclared_required`;
* the schema has no instance (:mod:`tpguide.guided.schema_check`, checked when
  the request is parsed);
* the grammar's first mask allows no token (``root ::= root "x"``, the regex
  ``[^\\s\\S]``), :func:`check_first_mask`.

Each message names the keyword or the reason and the JSON pointer.  A request
with ``"strict": false`` skips these checks (best effort); its output is still
validated (:mod:`tpguide.guided.schema_check`).  :func:`admit` runs the
checks and the compilation for one backend.
"""

from __future__ import annotations

import json
from typing import Any, Iterator, List, Tuple

from tpguide.guided.bitmask import allocate_token_bitmask, find_dead_end_rows
from tpguide.guided.enforcement import unenforced_keys
from tpguide.guided.keyword_cases import FORMAT_EXAMPLES, keyword_key
from tpguide.guided.matcher import GuidedBackend
from tpguide.guided.params import StructuredOutputsParams
from tpguide.guided.schema_check import resolve_local_ref

# ------------------------------------------------------------------ the fail-closed checks

class GuideRefused(ValueError):
    """A guide the backend cannot guarantee; the message says why and where."""


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
            found.append((pointer, f"$ref {value!r} does not resolve inside the schema (only local JSON pointers "
                                   f"'#/...' are followed), so no backend can enforce what it names"))
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


def check_enforceable(params: StructuredOutputsParams, backend_name: str) -> None:
    """Raise :class:`GuideRefused` if ``backend_name`` cannot enforce every keyword of ``params``' schema.

    A regex guide is checked as a schema ``pattern`` (xgrammar ignores
    look-around).  No-op for other guides and for ``params.strict == False``.

    Raises
    ------
    GuideRefused
        Lists each unenforced keyword with its JSON pointer into the schema,
        e.g. ``'uniqueItems' is not enforced by xgrammar (at /properties/tags/uniqueItems)``.
    """
    if not params.strict or params.guide_type not in ("json_schema", "regex", "structural_tag"):
        return
    if params.guide_type == "regex":  # a regex guide is refused where a schema "pattern" like it would be
        found = [(pointer, why.replace("'pattern", "'regex")) for pointer, why in
                 unenforced_keywords({"type": "string", "pattern": params.regex}, backend_name)]
    elif params.guide_type == "structural_tag":  # each JSON schema inside the tag (tool arguments, answers)
        found = [(where + pointer, why) for where, schema in tag_schemas(json.loads(params.guide_text))
                 for pointer, why in unenforced_keywords(schema, backend_name)]
    else:
        found = unenforced_keywords(json.loads(params.guide_text), backend_name)
    if found:
        shown = "; ".join(f"{why} (at {pointer})" for pointer, why in found[:8])
        more = f"; and {len(found) - 8} more" if len(found) > 8 else ""
        if any(why.startswith("'oneOf' ") for _, why in found):
            more += ("; a oneOf is enforced only where its branches are proved disjoint (by type, const/enum "
                     "or a required property)")
        raise GuideRefused(f"schema refused: {shown}{more}; set \"strict\": false in structured_output "
                           f"to run it best effort (the output is still validated)")


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


def check_first_mask(backend: GuidedBackend, compiled: Any, params: StructuredOutputsParams) -> None:
    """Raise :class:`GuideRefused` if a fresh matcher of ``compiled`` allows no token (strict only).

    Raises
    ------
    GuideRefused
        The first bitmask row has no allowed id below ``padded_vocab_size``:
        the grammar matches no string (e.g. ``root ::= root "x"``).
    """
    if not params.strict:
        return
    row = allocate_token_bitmask(1, backend.padded_vocab_size)
    try:
        backend.matcher(compiled).fill_next_token_bitmask(row, 0)
    except Exception as exc:  # noqa: BLE001 - a matcher that fails at once is refused
        raise GuideRefused(f"{params.guide_type} refused: the {backend.name} matcher fails at the first token: "
                           f"{exc}") from exc
    if bool(find_dead_end_rows(row, backend.padded_vocab_size).any()):
        raise GuideRefused(f"{params.guide_type} refused: the first mask of the {backend.name} grammar allows no "
                           f"token (the grammar matches no string)")


def admit(backend: GuidedBackend, params: StructuredOutputsParams) -> Tuple[str, Any]:
    """Check and compile ``params`` for ``backend``; returns ``(backend name that runs it, compiled)``.

    ``backend`` may be an :class:`AutoBackend`,
    whose ``compile`` chooses the backend and runs these checks itself.

    Raises
    ------
    GuideRefused
        See :func:`check_enforceable` and :func:`check_first_mask`.
    ValueError
        The guide does not compile (the backend's message).
    """
    if getattr(backend, "is_auto", False):
        compiled = backend.compile(params)
        return compiled.backend_name, compiled
    check_enforceable(params, backend.name)
    compiled = backend.compile(params)
    check_first_mask(backend, compiled, params)
    return backend.name, compiled
