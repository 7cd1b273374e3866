"""Reject JSON schemas that no finite JSON value satisfies, before any backend sees them.

A grammar compiler happily compiles ``{"$ref": "#/$defs/a", "$defs": {"a":
{"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required":
["x"]}}}``: every instance must contain an instance, so generation can only
run until ``max_tokens`` and finish with ``"length"``, never with valid
output.  :func:`check_schema_has_finite_instance` finds such schemas and
raises a :class:`ValueError` naming the ``$ref`` chain.

The test is the classic "productive nonterminal" fixpoint of a context-free
grammar, run as a depth-first search: a schema is productive when some
finite derivation exists, and a shortest derivation never visits the same
``$ref`` twice on one path, so a ``$ref`` already on the path counts as
unproductive there.  Only what certainly forces a sub-value counts (required
properties, ``minItems``, ``prefixItems``, ``allOf``, ``$ref``); anything
unknown is assumed productive, so the check never rejects a schema that has
an instance.  Contradictions *inside* one value (``minimum > maximum``,
``minLength > maxLength``) are the backends' job; both reject them.
"""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, List, Optional

#: Work limit (schema nodes visited); beyond it the schema is assumed fine.
MAX_VISITS = 20_000


class _Search:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.visits = 0
        self.cycles: List[str] = []  # "$ref" chains that closed a cycle
        self.proven: set = set()  # refs known productive (independent of the path)

    def resolve(self, ref: str) -> Optional[Any]:
        """The sub-schema of a local ``#/a/b`` pointer, else None (unknown: assumed productive)."""
        if not ref.startswith("#"):
            return None
        node = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node

    def productive(self, schema: Any, path: FrozenSet[str], chain: tuple) -> bool:
        self.visits += 1
        if self.visits > MAX_VISITS:
            return True
        if schema is False:
            return False
        if not isinstance(schema, dict):
            return True
        if "$ref" in schema and isinstance(schema["$ref"], str):
            ref = schema["$ref"]
            if ref in path:
                self.cycles.append(" -> ".join(chain + (ref,)))
                return False
            if ref not in self.proven:
                target = self.resolve(ref)
                if target is not None and not self.productive(target, path | {ref}, chain + (ref,)):
                    return False
                self.proven.add(ref)
        if "const" in schema or "enum" in schema:
            return True  # a literal (backends check it against the rest)
        for key in ("allOf",):
            if isinstance(schema.get(key), list) and not all(
                    self.productive(s, path, chain) for s in schema[key]):
                return False
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key] and not any(
                    self.productive(s, path, chain) for s in schema[key]):
                return False
        types = schema.get("type")
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not types:
            types = ["object"] if "properties" in schema else (["array"] if "items" in schema else [None])
        return any(self._productive_type(t, schema, path, chain) for t in types)

    def _productive_type(self, type_: Any, schema: Dict[str, Any], path: FrozenSet[str], chain: tuple) -> bool:
        if type_ == "object":
            props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
            required = schema.get("required") if isinstance(schema.get("required"), list) else []
            return all(self.productive(props[name], path, chain)
                       for name in required if isinstance(name, str) and name in props)
        if type_ == "array":
            prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
            min_items = schema.get("minItems", 0)
            min_items = min_items if isinstance(min_items, int) and not isinstance(min_items, bool) else 0
            if not all(self.productive(s, path, chain) for s in prefix[:min_items]):
                return False
            if min_items > len(prefix) and "items" in schema:
                return self.productive(schema["items"], path, chain)
            return True
        return True


def check_schema_has_finite_instance(schema: Any) -> None:
    """Raise ``ValueError`` if no finite JSON value can satisfy ``schema``.

    Parameters
    ----------
    schema : dict or bool
        A decoded JSON schema.

    Raises
    ------
    ValueError
        The root is unproductive: a ``$ref`` cycle with no base case (the
        message shows the chain, e.g. ``#/$defs/a -> #/$defs/a``), or ``false``.
    """
    search = _Search(schema)
    if search.productive(schema, frozenset({"#"}), ("#",)):
        return
    if search.cycles:
        shown = "; ".join(dict.fromkeys(search.cycles))
        raise ValueError(f"json schema has no finite instance: $ref cycle with no base case ({shown})")
    raise ValueError("json schema has no finite instance (a required part is the schema false)")
