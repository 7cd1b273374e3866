"""A guide's semantics, checked independently of the backends: satisfiable up front, satisfied at the end.

Two checks, both fail closed (docs/architecture.md §5):

* **up front**, :func:`check_schema_has_finite_instance`: a JSON schema that
  no finite JSON value satisfies is refused when the request is parsed;
* **at the end**, :func:`validate_output`: every guided output that finishes
  ``"stop"`` is validated before it is reported (the last line of defence).

**Satisfiability.**  A grammar compiler happily compiles ``{"$ref": "#/$defs/a", "$defs": {"a":
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
an instance.

Contradictions inside one forced value count as unproductive too, each
reported with its JSON pointer into the schema (:func:`local_contradiction`):
an empty ``anyOf``/``oneOf``/``enum``/``type``, a ``required`` property that
``additionalProperties: false`` forbids, an ``allOf`` (or ``type`` beside
``const``/``enum``) whose types have no value in common, ``not: {}``, and
lower bounds above upper bounds.  xgrammar compiles such schemas and then
produces invalid text (``""`` for ``{"anyOf": []}``), so they are refused
before any backend sees them.

**Output validation.**  A grammar backend can be wrong (a keyword it drops,
a bug), so every guided output that finishes with ``"stop"`` is validated
independently:

* ``json_schema`` / ``json``: :mod:`jsonschema` with its format checkers, the
  validator class of the schema's ``$schema`` (draft-07 when the schema uses
  draft-07-only spellings and says nothing, else 2020-12);
* ``regex``: Python's :mod:`re` ``fullmatch``.  xgrammar's regex dialect is
  ECMAScript-like and llguidance's is Rust ``regex``; for the syntax the
  three share the meaning is the same, and Python's ``\\d``, ``\\w``, ``\\s``
  are supersets of both (Unicode), so a correct output never fails here.  A
  pattern Python cannot compile (dialect-only syntax) is not checked;
* ``choice``: the text is one of the choices;
* ``grammar`` and ``structural_tag``: no independent checker exists; the
  matcher's own termination is the check.

A failing output becomes ``finish_reason="error"`` with the message, keeping
its text and token ids.
"""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING, Any, Dict, FrozenSet, List, Optional, Protocol, Tuple

#: seconds the last-line check of a regex output may take (fail closed past it: the request errors)
REGEX_CHECK_TIMEOUT_S = 2.0

if TYPE_CHECKING:
    import jsonschema

#: Work limit (schema nodes visited); beyond it the schema is assumed fine.
MAX_VISITS = 20_000


_JSON_TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")

_BOUNDS = (("minimum", "maximum"), ("minLength", "maxLength"), ("minItems", "maxItems"),
           ("minProperties", "maxProperties"))


def schema_types(schema: Dict[str, Any]) -> Optional[set]:
    """The JSON types ``schema`` allows by its ``type``/``const``/``enum`` (None: unrestricted).

    A superset of the types of its instances: other keywords can only narrow
    it.  ``"integer"`` values also count as ``"number"`` ones when narrowing.
    Also used by :mod:`tpguide.guided.disjoint`.
    """
    types = schema.get("type")
    allowed = None
    if isinstance(types, str):
        allowed = {types}
    elif isinstance(types, list):
        allowed = {t for t in types if isinstance(t, str)}
    if "integer" in (allowed or ()):
        allowed = allowed | {"integer"}
    if "const" in schema:
        allowed = _narrow(allowed, {_type_of_value(schema["const"])})
    if isinstance(schema.get("enum"), list):
        allowed = _narrow(allowed, {_type_of_value(v) for v in schema["enum"]})
    return allowed


def _type_of_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "unknown")


def _narrow(allowed: Optional[set], values: set) -> set:
    """Types in ``allowed`` (None: all) that one of the value types ``values`` has."""
    if allowed is None:
        return set(values)
    out = {t for t in values if t in allowed or (t == "integer" and "number" in allowed)}
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def local_contradiction(schema: Any) -> Optional[str]:
    """Why no value satisfies the dict ``schema`` by its own keywords, or None (subschemas unvisited).

    Conservative: None whenever in doubt, so a schema with an instance is never reported.
    """
    if not isinstance(schema, dict):
        return None
    for key in ("anyOf", "oneOf", "enum", "type"):
        if schema.get(key) == []:
            return f"{key} is an empty list: no value satisfies it"
    if schema.get("not") in ({}, True):
        return "not {} matches no value"
    for low, high in _BOUNDS:
        if _number(schema.get(low)) and _number(schema.get(high)) and schema[low] > schema[high]:
            return f"{low}={schema[low]} > {high}={schema[high]}"
    types = schema_types(schema)
    if types is not None and not types:
        return f"type {schema.get('type')!r} admits none of the const/enum values"
    if isinstance(schema.get("allOf"), list):
        allowed = types
        for member in schema["allOf"]:
            member_types = schema_types(member) if isinstance(member, dict) else None
            if member_types is not None:
                allowed = member_types if allowed is None else _intersect(allowed, member_types)
        if allowed is not None and not allowed:
            shown = [m.get("type") for m in schema["allOf"] if isinstance(m, dict) and "type" in m]
            parent = f" (and type {schema['type']!r})" if "type" in schema else ""
            return f"allOf: the types {shown}{parent} have no value in common"
    return _forbidden_required(schema)


def _intersect(a: set, b: set) -> set:
    out = a & b
    if "number" in a and "integer" in b or "number" in b and "integer" in a:
        out.add("integer")
    return out


def _forbidden_required(schema: Dict[str, Any]) -> Optional[str]:
    if schema.get("additionalProperties") is not False or not isinstance(schema.get("required"), list):
        return None
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    patterns = schema.get("patternProperties") if isinstance(schema.get("patternProperties"), dict) else {}
    for name in schema["required"]:
        if not isinstance(name, str) or name in props:
            continue
        try:
            if any(re.search(p, name) for p in patterns):
                continue
        except re.error:
            return None
        return (f"required property {name!r} is forbidden: additionalProperties is false and "
                f"neither properties nor patternProperties allow it")
    return None


def _child(pointer: str, *parts: Any) -> str:
    return pointer + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def json_pointer_get(document: Any, pointer: str, default: Any = None) -> Any:
    """The value at the JSON Pointer ``pointer`` (RFC 6901, ``""`` = the whole document), else ``default``."""
    if pointer and not pointer.startswith("/"):
        return default
    node = document
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return default
    return node


def resolve_local_ref(root: Any, ref: str) -> Optional[Any]:
    """The sub-schema of ``root`` that a ``$ref`` into the same document names, else None.

    Same document: ``#``, a JSON pointer ``#/a/b``, an anchor ``#name``
    (``"$anchor": "name"``, or draft-07's ``"$id": "#name"``), or any of these
    after the root's own ``$id``.  None for a ref into another document
    (``other.json#/x``) or one that does not resolve.
    """
    base, _, fragment = ref.partition("#")
    root_id = root.get("$id") if isinstance(root, dict) else None
    if base and (not isinstance(root_id, str) or base != root_id.partition("#")[0]):
        return None
    if fragment and not fragment.startswith("/"):
        return _find_anchor(root, fragment)
    return json_pointer_get(root, fragment)


def _find_anchor(node: Any, name: str) -> Optional[Any]:
    """The sub-schema with ``"$anchor": name`` (or ``"$id": "#name"``), searched depth first, else None."""
    if isinstance(node, dict):
        if node.get("$anchor") == name or node.get("$id") == f"#{name}":
            return node
        children = node.values()
    elif isinstance(node, list):
        children = node
    else:
        return None
    for child in children:
        found = _find_anchor(child, name)
        if found is not None:
            return found
    return None


class _Search:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.visits = 0
        self.contradictions: List[str] = []  # "pointer: why" of forced values no value satisfies
        self.cycles: List[str] = []  # "$ref" chains that closed a cycle
        self.proven: set = set()  # refs known productive (independent of the path)

    def resolve(self, ref: str) -> Optional[Any]:
        """The sub-schema of a local ``#/a/b`` pointer, else None (unknown: assumed productive)."""
        return resolve_local_ref(self.root, ref)

    def productive(self, schema: Any, path: FrozenSet[str], chain: tuple, pointer: str = "") -> bool:
        self.visits += 1
        if self.visits > MAX_VISITS:
            return True
        if schema is False:
            self.contradictions.append(f"{pointer or '/'}: the schema false")
            return False
        if not isinstance(schema, dict):
            return True
        why = local_contradiction(schema)
        if why is not None:
            self.contradictions.append(f"{pointer or '/'}: {why}")
            return False
        if "$ref" in schema and isinstance(schema["$ref"], str):
            ref = schema["$ref"]
            if ref in path:
                self.cycles.append(" -> ".join(chain + (ref,)))
                return False
            if ref not in self.proven:
                target = self.resolve(ref)
                if target is not None and not self.productive(target, path | {ref}, chain + (ref,), ref[1:]):
                    return False
                self.proven.add(ref)
        if "const" in schema or "enum" in schema:
            return True  # a literal (backends check it against the rest)
        if isinstance(schema.get("allOf"), list) and not all(
                self.productive(s, path, chain, _child(pointer, "allOf", i)) for i, s in enumerate(schema["allOf"])):
            return False
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key] and not any(
                    [self.productive(s, path, chain, _child(pointer, key, i)) for i, s in enumerate(schema[key])]):
                return False
        types = schema.get("type")
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not types:
            types = ["object"] if "properties" in schema else (["array"] if "items" in schema else [None])
        return any([self._productive_type(t, schema, path, chain, pointer) for t in types])

    def _productive_type(self, type_: Any, schema: Dict[str, Any], path: FrozenSet[str], chain: tuple,
                         pointer: str) -> bool:
        if type_ == "object":
            props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
            required = schema.get("required") if isinstance(schema.get("required"), list) else []
            return all(self.productive(props[name], path, chain, _child(pointer, "properties", name))
                       for name in required if isinstance(name, str) and name in props)
        if type_ == "array":
            prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
            min_items = schema.get("minItems", 0)
            min_items = min_items if isinstance(min_items, int) and not isinstance(min_items, bool) else 0
            if not all(self.productive(s, path, chain, _child(pointer, "prefixItems", i))
                       for i, s in enumerate(prefix[:min_items])):
                return False
            if min_items > len(prefix) and "items" in schema:
                return self.productive(schema["items"], path, chain, _child(pointer, "items"))
            return True
        return True


def finite_instance_problems(schema: Any) -> Tuple[List[str], List[Tuple[str, str]]]:
    """Why no finite JSON value satisfies ``schema``: ``(cycles, contradictions)``, both empty when one does.

    ``cycles``: the ``$ref`` chains that close a cycle with no base case
    (e.g. ``#/$defs/a -> #/$defs/a``); ``contradictions``: ``(JSON pointer of
    the schema node, reason)`` of each forced value no value satisfies, the
    root's pointer written ``/``.  The one search behind
    :func:`check_schema_has_finite_instance` and the guide check
    (:mod:`tpguide.guided.guide_check`).
    """
    search = _Search(schema)
    if search.productive(schema, frozenset({"#"}), ("#",)):
        return [], []
    contradictions = [tuple(c.split(": ", 1)) for c in dict.fromkeys(search.contradictions)]
    return list(dict.fromkeys(search.cycles)), contradictions


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
        message shows the chain, e.g. ``#/$defs/a -> #/$defs/a``), ``false``,
        or a contradiction (the message gives its JSON pointer into the
        schema and the reason, e.g. ``/anyOf: anyOf is an empty list``).
    """
    cycles, contradictions = finite_instance_problems(schema)
    if not cycles and not contradictions:
        return
    parts = []
    if cycles:
        parts.append(f"$ref cycle with no base case ({'; '.join(cycles)})")
    if contradictions:
        parts.append(f"unsatisfiable at {'; '.join(f'{p}: {why}' for p, why in contradictions)}")
    raise ValueError(f"json schema has no finite instance: {'; '.join(parts)}")


# ------------------------------------------------------------------ output validation

#: Keywords (with the value shapes) that only draft-07 and older know.
_DRAFT07_ONLY = ("definitions", "dependencies", "additionalItems")


def _uses_draft07_spelling(schema: Any) -> bool:
    if isinstance(schema, dict):
        if any(k in schema for k in _DRAFT07_ONLY) or isinstance(schema.get("items"), list):
            return True
        return any(_uses_draft07_spelling(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_uses_draft07_spelling(v) for v in schema)
    return False


def import_jsonschema():
    """:mod:`jsonschema`, imported on first use.

    A process that never checks a schema (a non-driver rank, an unguided run)
    does not import it; the engine imports it at start-up in its
    grammar-tables thread (:func:`~tpguide.engine.startup.start_engine`), so no
    request waits for it either.  ``rfc3987_syntax`` (1.4 s of CPU: Lark
    parsers built at import) is imported only by the first ``iri`` /
    ``iri-reference`` format check (:mod:`tpguide.guided.lazy_iri_syntax`).
    """
    from tpguide.guided.lazy_iri_syntax import import_jsonschema_lazily

    return import_jsonschema_lazily()


def check_valid_schema(schema: Any) -> None:
    """Raise ValueError unless ``schema`` is valid against its dialect's metaschema (``{"maxLength": -1}`` is not).

    An invalid schema is the client's error: refused up front (a 400) rather
    than generated and then failed by the output check (a 500).  The message
    names the metaschema's complaint and the JSON pointer of the bad keyword.
    """
    jsonschema = import_jsonschema()
    cls = _validator_class(schema)
    try:
        cls.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        pointer = _child("", *exc.path)
        raise ValueError(f"json schema is not a valid JSON Schema ({cls.__name__.replace('Validator', '')}): "
                         f"{exc.message} (at {pointer or '/'})") from None


def validator_for_schema(schema: Any) -> jsonschema.protocols.Validator:
    """A :mod:`jsonschema` validator (with format checking) for ``schema``'s dialect.

    Raises
    ------
    jsonschema.exceptions.SchemaError
        ``schema`` is not a valid schema of its dialect.
    """
    cls = _validator_class(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def _validator_class(schema: Any) -> type:
    """The :mod:`jsonschema` validator class of ``schema``'s dialect (``$schema``, else by its spelling)."""
    jsonschema = import_jsonschema()
    default = jsonschema.Draft7Validator if _uses_draft07_spelling(schema) else jsonschema.Draft202012Validator
    return jsonschema.validators.validator_for(schema, default=default)


@functools.lru_cache(maxsize=256)
def check_valid_schema_text(schema_text: str) -> None:
    """:func:`check_valid_schema` of a schema's JSON text, cached by the text (the metaschema check costs
    milliseconds per request; a ValueError is raised again on every call, as exceptions are not cached)."""
    check_valid_schema(json.loads(schema_text))


@functools.lru_cache(maxsize=256)
def _validator_of_text(schema_text: str) -> Optional[jsonschema.protocols.Validator]:
    schema = json.loads(schema_text)
    try:
        return validator_for_schema(schema)
    except import_jsonschema().exceptions.SchemaError:
        return None  # the backend compiled it; jsonschema cannot judge it


class Guide(Protocol):
    """What :func:`validate_output` reads of a guide (a :class:`~tpguide.guided.params.StructuredOutputsParams`,
    which imports this module to check its schema up front)."""

    guide_type: str
    guide_text: str
    regex: Optional[str]
    choice: Optional[tuple]


def validate_output(params: Guide, text: str) -> Optional[str]:
    """Why ``text`` does not satisfy ``params``, or None when it does (or no checker exists).

    Parameters
    ----------
    params : Guide
        A :class:`~tpguide.guided.params.StructuredOutputsParams`.
    text : str
        The decoded output (special tokens skipped).

    Returns
    -------
    str or None
        A message naming the guide type, the failed keyword and the JSON
        pointers into the instance and the schema, e.g. ``output fails its
        json_schema: 7 is greater than the maximum of 5 (instance at /a,
        schema at /properties/a/maximum)``.
    """
    kind = params.guide_type
    if kind in ("json_schema", "json"):
        try:
            instance = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"output is not valid JSON ({exc}): {text[:80]!r}"
        validator = _validator_of_text(params.guide_text)
        if validator is None:
            return None
        error = import_jsonschema().exceptions.best_match(validator.iter_errors(instance))
        if error is None:
            return None
        return (f"output fails its {kind}: {error.message} (instance at {_child('', *error.absolute_path) or '/'}, "
                f"schema at {_child('', *error.absolute_schema_path)})")
    if kind == "regex":
        import regex as regex_engine  # transformers' dependency: re's syntax, with a time limit

        try:
            pattern = regex_engine.compile(params.regex)
        except regex_engine.error:
            return None
        try:  # a backtracking engine: nested quantifiers can take exponential time on a near miss
            matched = pattern.fullmatch(text, timeout=REGEX_CHECK_TIMEOUT_S)
        except TimeoutError:
            return (f"output could not be checked against its regex {params.regex!r} within "
                    f"{REGEX_CHECK_TIMEOUT_S} s (nested quantifiers backtrack): {text[:80]!r}")
        if matched is None:
            return f"output does not match its regex {params.regex!r}: {text[:80]!r}"
        return None
    if kind == "choice":
        if text not in params.choice:
            return f"output {text[:80]!r} is none of the choices {list(params.choice)[:8]}"
        return None
    return None
