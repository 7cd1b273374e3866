"""A guide's canonical hash: the same guide in another keyword order hashes alike (docs/receipts.md).

:func:`canonical_schema_text` writes a JSON schema with every object's keys
sorted, except where order decides the output:

* the names inside ``properties``: the grammar writes an object's properties
  in that order, so ``{"a", "b"}`` and ``{"b", "a"}`` generate different text;
* data values (``const``, ``enum``, ``default``, ``examples``): a ``const``
  object is written with its keys in the order given, so data is kept as it
  is, lists and objects alike.

Lists keep their order everywhere (``anyOf`` branches are tried in order,
``prefixItems`` is positional).  Numbers keep their spelling (``1`` and
``1.0`` hash apart).  :func:`guide_hash` hashes the guide kind with that
text (``sha256:<hex>``); ``strict`` and the whitespace mode are separate
receipt fields, not part of the hash.  A regex, a grammar and a choice list
are hashed as their text.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from tpguide.guided.params import StructuredOutputsParams

__all__ = ["DATA_KEYWORDS", "ORDERED_MAPS", "canonical_schema_text", "guide_hash"]

#: Keywords whose value is data, written as given (key order included).
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
#: Keywords whose value is a name -> subschema map whose order counts.
ORDERED_MAPS = frozenset({"properties"})
#: Guide kinds whose text is JSON and is canonicalised; the others are hashed as their text.
_JSON_KINDS = frozenset({"json_schema", "json", "structural_tag"})


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def canonical_schema_text(node: Any) -> str:
    """``node`` (a decoded JSON schema, or any JSON value) as canonical compact JSON text.

    Object keys sorted, except the names inside ``properties`` and the values
    of :data:`DATA_KEYWORDS` (see the module docstring).  The result is valid
    JSON that decodes to a value equal to ``node``.
    """
    if isinstance(node, list):
        return "[" + ",".join(canonical_schema_text(x) for x in node) + "]"
    if not isinstance(node, dict):
        return _dump(node)
    parts = []
    for key in sorted(node):
        value = node[key]
        if key in DATA_KEYWORDS:
            text = _dump(value)
        elif key in ORDERED_MAPS and isinstance(value, dict):
            text = "{" + ",".join(f"{_dump(name)}:{canonical_schema_text(sub)}" for name, sub in value.items()) + "}"
        else:
            text = canonical_schema_text(value)
        parts.append(f"{_dump(key)}:{text}")
    return "{" + ",".join(parts) + "}"


def guide_hash(params: StructuredOutputsParams) -> str:
    """``"sha256:<hex>"`` of the guide's kind and canonical text (see the module docstring).

    Parameters
    ----------
    params : StructuredOutputsParams
        A validated guide; ``json_object`` hashes as its schema ``{"type": "object"}``.
    """
    kind = params.guide_type
    text = canonical_schema_text(json.loads(params.guide_text)) if kind in _JSON_KINDS else params.guide_text
    return "sha256:" + hashlib.sha256(f"{kind}\n{text}".encode("utf-8", "surrogatepass")).hexdigest()
