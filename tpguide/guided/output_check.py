"""The last line of defence: check a finished output against its guide before it is reported ``"stop"``.

A grammar backend can be wrong (a keyword it drops, a bug), so every guided
output that finishes with ``"stop"`` is validated independently
(docs/architecture.md §5, fail closed):

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
from typing import Any, Optional

import jsonschema

from tpguide.guided.params import StructuredOutputsParams

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


def validator_for_schema(schema: Any) -> jsonschema.protocols.Validator:
    """A :mod:`jsonschema` validator (with format checking) for ``schema``'s dialect.

    Raises
    ------
    jsonschema.exceptions.SchemaError
        ``schema`` is not a valid schema of its dialect.
    """
    default = jsonschema.Draft7Validator if _uses_draft07_spelling(schema) else jsonschema.Draft202012Validator
    cls = jsonschema.validators.validator_for(schema, default=default)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


@functools.lru_cache(maxsize=256)
def _validator_of_text(schema_text: str) -> Optional[jsonschema.protocols.Validator]:
    schema = json.loads(schema_text)
    try:
        return validator_for_schema(schema)
    except jsonschema.exceptions.SchemaError:
        return None  # the backend compiled it; jsonschema cannot judge it


def _pointer(path: Any) -> str:
    return "/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in path) if path else ""


def validate_output(params: StructuredOutputsParams, text: str) -> Optional[str]:
    """Why ``text`` does not satisfy ``params``, or None when it does (or no checker exists).

    Parameters
    ----------
    params : StructuredOutputsParams
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
        error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
        if error is None:
            return None
        return (f"output fails its {kind}: {error.message} (instance at {_pointer(error.absolute_path) or '/'}, "
                f"schema at {_pointer(error.absolute_schema_path)})")
    if kind == "regex":
        try:
            pattern = re.compile(params.regex)
        except re.error:
            return None
        if pattern.fullmatch(text) is None:
            return f"output does not match its regex {params.regex!r}: {text[:80]!r}"
        return None
    if kind == "choice":
        if text not in params.choice:
            return f"output {text[:80]!r} is none of the choices {list(params.choice)[:8]}"
        return None
    return None
