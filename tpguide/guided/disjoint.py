"""Provably disjoint ``oneOf`` branches: where "exactly one" equals "at least one".

docs/architecture.md §5: xgrammar and llguidance (with ``coerce_one_of``)
compile ``oneOf`` as ``anyOf``, which does not enforce "exactly one branch"
in general.  When no instance can satisfy two branches at once, the two
keywords accept the same instances, so such a ``oneOf`` is enforced and need
not be refused.

The proof is sound and incomplete: it looks only at a few keywords of each
branch (``type``, ``const``, ``enum``, and ``properties`` of ``required``
names, recursively), and a keyword it ignores can only shrink a branch's
instance set, never make disjoint branches overlap.  A branch with ``$ref``
is replaced by its target (in draft-07 the siblings of ``$ref`` are ignored,
in 2020-12 they shrink the set further: either way the target bounds it).
Anything else it cannot decide counts as overlapping, so the ``oneOf`` stays
refused.  This is the discriminator pattern of OpenAPI (a required property
with a distinct ``const`` per branch) and the "one type per branch" pattern.
"""

from __future__ import annotations

import json
from typing import AbstractSet, Any, FrozenSet, Optional

from tpguide.guided.schema_check import schema_types

_MAX_DEPTH = 8


def one_of_branches_disjoint(branches: Any, root: Any = None) -> bool:
    """True if no JSON value can satisfy two of ``branches`` (a ``oneOf`` value) at once.

    Parameters
    ----------
    branches : list
        The ``oneOf`` array: subschemas (dicts or booleans).
    root : dict, optional
        The whole schema, to resolve local ``$ref`` pointers (``#/...``);
        without it a ``$ref`` branch counts as overlapping.

    Returns False for anything it cannot prove (see the module docstring);
    never raises.
    """
    if not isinstance(branches, list) or len(branches) < 2:
        return isinstance(branches, list)
    resolved = [_resolve(b, root, 0) for b in branches]
    return all(_disjoint(resolved[i], resolved[j], root, 0)
               for i in range(len(resolved)) for j in range(i + 1, len(resolved)))


def _resolve(schema: Any, root: Any, depth: int) -> Any:
    while isinstance(schema, dict) and "$ref" in schema and depth < _MAX_DEPTH:
        ref = schema["$ref"]
        if not (isinstance(ref, str) and ref.startswith("#") and isinstance(root, dict)):
            return None
        node: Any = root
        for part in (p for p in ref[1:].split("/") if p):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        schema, depth = node, depth + 1
    return None if isinstance(schema, dict) and "$ref" in schema else schema


def _disjoint(a: Any, b: Any, root: Any, depth: int) -> bool:
    if a is False or b is False:
        return True  # a branch that accepts nothing overlaps nothing
    if not isinstance(a, dict) or not isinstance(b, dict) or depth >= _MAX_DEPTH:
        return False
    types_a, types_b = schema_types(a), schema_types(b)
    if not _types_overlap(types_a, types_b):
        return True
    values_a, values_b = _values(a), _values(b)
    if values_a is not None and values_b is not None and not (values_a & values_b):
        return True
    objects_only = types_a is not None and types_a <= {"object"} and types_b is not None and types_b <= {"object"}
    if objects_only:
        shared = _required(a) & _required(b)
        for name in sorted(shared):
            sub_a = _resolve(_property(a, name), root, depth)
            sub_b = _resolve(_property(b, name), root, depth)
            if sub_a is not None and sub_b is not None and _disjoint(sub_a, sub_b, root, depth + 1):
                return True
        if _excludes_required(a, b) or _excludes_required(b, a):
            return True
    return False


def _types_overlap(a: Optional[AbstractSet[str]], b: Optional[AbstractSet[str]]) -> bool:
    """Some value has a type of ``a`` and one of ``b`` (an "integer" is also a "number"; None: any type)."""
    if a is None or b is None:
        return True
    return bool(a & b) or ("integer" in a and "number" in b) or ("number" in a and "integer" in b)


def _raw_values(schema: dict) -> Optional[list]:
    if "const" in schema:
        return [schema["const"]]
    enum = schema.get("enum")
    return list(enum) if isinstance(enum, list) else None


def _values(schema: dict) -> Optional[FrozenSet[str]]:
    """``const`` / ``enum`` values in a canonical form (1 and 1.0 equal, true and 1 not), None if absent."""
    values = _raw_values(schema)
    return None if values is None else frozenset(_canonical(v) for v in values)


def _canonical(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return "n:" + repr(float(value))
    if isinstance(value, list):
        return "[" + ",".join(_canonical(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_canonical(v)}" for k, v in sorted(value.items())) + "}"
    return json.dumps(value)


def _required(schema: dict) -> FrozenSet[str]:
    req = schema.get("required")
    return frozenset(x for x in req if isinstance(x, str)) if isinstance(req, list) else frozenset()


def _property(schema: dict, name: str) -> Any:
    props = schema.get("properties")
    return props.get(name) if isinstance(props, dict) else None


def _excludes_required(a: dict, b: dict) -> bool:
    """``a`` requires a property that ``b`` forbids (``additionalProperties: false``, not listed, no patterns)."""
    if b.get("additionalProperties") is not False or b.get("patternProperties"):
        return False
    listed = b.get("properties") if isinstance(b.get("properties"), dict) else {}
    return any(name not in listed for name in _required(a))
