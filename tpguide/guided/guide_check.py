"""The guide check: what admission would say of a guide, without generating (docs/receipts.md).

:func:`check_guide` runs the code generation runs, in the same order: the
request's ``structured_output`` parsed and checked for a finite instance
(:meth:`StructuredOutputsParams.from_request`, :mod:`tpguide.guided.schema_check`),
then :func:`~tpguide.guided.admission.admit` on the engine's backend (``auto``
tries each backend), so its verdict is generation's.  Around that verdict it
reports, from the same keyword walk admission uses
(:func:`~tpguide.guided.schema_keywords.schema_keywords`,
:func:`~tpguide.guided.schema_keywords.unenforced_keywords`):

* each reason with a JSON Pointer into the schema and the keyword;
* which keyword uses the grammar enforces, which are checked only after
  generation (``"strict": false``), which are refused, which are
  annotations, and which are unknown to every validator (a typo such as
  ``propertieC``: it constrains nothing);
* the backend that runs it (what ``auto`` chooses), the compile time, and the
  guide hash a receipt carries (:func:`~tpguide.guided.guide_hash.guide_hash`).
"""

from __future__ import annotations

import itertools
import json
import re
import time
from typing import Any, Dict, List, Optional

from tpguide.guided.admission import admit
from tpguide.guided.compile_service import CompileService
from tpguide.guided.enforcement import MEASURED, REFUSED
from tpguide.guided.guide_hash import guide_hash
from tpguide.guided.keyword_cases import keyword_key
from tpguide.guided.matcher import GuidedBackend
from tpguide.guided.params import StructuredOutputsParams
from tpguide.guided.schema_check import finite_instance_problems, json_pointer_get
from tpguide.guided.schema_keywords import schema_keywords, unenforced_keywords

__all__ = ["ANNOTATIONS", "VALIDATION_KEYWORDS", "check_guide"]

#: Keywords that constrain nothing (identifiers, documentation, data examples).
ANNOTATIONS = frozenset({"$schema", "$id", "$comment", "title", "description", "default", "examples",
                         "deprecated", "readOnly", "writeOnly", "$defs", "definitions"})
#: Keywords of JSON Schema (2020-12 and draft-07) that constrain a value; any other key is unknown to every
#: validator and backend (a typo such as ``propertieC``) and constrains nothing.
VALIDATION_KEYWORDS = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "uniqueItems", "maxContains",
    "minContains", "maxProperties", "minProperties", "required", "dependentRequired", "properties",
    "patternProperties", "additionalProperties", "propertyNames", "items", "prefixItems", "additionalItems",
    "contains", "unevaluatedItems", "unevaluatedProperties", "allOf", "anyOf", "oneOf", "not", "if", "then",
    "else", "dependentSchemas", "dependencies", "$ref", "$dynamicRef", "$recursiveRef", "$anchor",
    "$dynamicAnchor", "$recursiveAnchor", "$vocabulary", "contentEncoding", "contentMediaType", "contentSchema"})
_KEYS = itertools.count()
_WORD = re.compile(r"[A-Za-z$][A-Za-z0-9$]*")


def _last_keyword(pointer: str) -> Optional[str]:
    return pointer.rsplit("/", 1)[-1].replace("~1", "/").replace("~0", "~") if pointer else None


def _closing_ref(schema: Any, chain: str) -> str:
    """The pointer of the ``$ref`` that closes ``chain`` (``# -> #/$defs/a -> #/$defs/a``): inside the
    chain's last-but-one target, the first ``$ref`` to its last; else that target."""
    refs = chain.split(" -> ")
    inside, target = refs[-2].removeprefix("#"), refs[-1]
    for pointer, keyword, value, _ in schema_keywords(schema):
        if keyword == "$ref" and value == target and pointer.startswith(inside + "/"):
            return pointer
    return target.removeprefix("#")


def _unsatisfiable_reasons(schema: Any) -> List[Dict[str, Any]]:
    """One reason per contradiction / ``$ref`` cycle, the pointer at the keyword where one is named."""
    cycles, contradictions = finite_instance_problems(schema)
    reasons = [{"pointer": _closing_ref(schema, chain), "keyword": "$ref",
                "message": f"$ref cycle with no base case ({chain})"} for chain in cycles]
    for node_pointer, why in contradictions:
        node_pointer = "" if node_pointer == "/" else node_pointer
        node = json_pointer_get(schema, node_pointer)
        word = _WORD.match(why)
        keyword = word.group(0) if word and isinstance(node, dict) and word.group(0) in node else None
        pointer = f"{node_pointer}/{keyword}" if keyword else node_pointer
        reasons.append({"pointer": pointer, "keyword": keyword, "message": why})
    return reasons


def not_compiled_keywords(schema: Any, backend_name: str) -> List[tuple]:
    """``(JSON pointer, reason)`` of each keyword use that ``backend_name`` refuses to compile at all
    (:data:`~tpguide.guided.enforcement.MEASURED` ``refused``: llguidance's ``uniqueItems``, ``contains``, ...)."""
    table = MEASURED.get(backend_name, {})
    return [(pointer, f"{key!r} is not compiled by {backend_name}")
            for pointer, keyword, value, node in schema_keywords(schema)
            if table.get(key := keyword_key(keyword, value, node, schema)) == REFUSED]


def _keyword_table(schema: Any, backend_name: str, strict: bool) -> Dict[str, List[str]]:
    """Keyword uses by pointer: enforced by ``backend_name``'s grammar, checked after generation, refused,
    annotations, and unknown keys (no validator or backend reads them)."""
    unenforced = {pointer for pointer, _ in unenforced_keywords(schema, backend_name)}
    not_compiled = {pointer for pointer, _ in not_compiled_keywords(schema, backend_name)}
    table: Dict[str, List[str]] = {"enforced": [], "checked_after_generation": [], "refused": [], "annotations": [],
                                   "unknown": []}
    for pointer, keyword, _, _ in schema_keywords(schema):
        if pointer in not_compiled:  # the backend does not compile it, strict or not
            table["refused"].append(pointer)
        elif pointer in unenforced:
            table["refused" if strict else "checked_after_generation"].append(pointer)
        elif keyword in ANNOTATIONS:
            table["annotations"].append(pointer)
        elif keyword in VALIDATION_KEYWORDS:
            table["enforced"].append(pointer)
        else:
            table["unknown"].append(pointer)
    return table


def _schema_of(params: StructuredOutputsParams) -> Optional[Any]:
    """The schema the keyword walk sees: the guide's, a regex as a string ``pattern``, else None."""
    if params.guide_type in ("json_schema", "json"):
        return json.loads(params.guide_text)
    if params.guide_type == "regex":
        return {"type": "string", "pattern": params.regex}
    return None


def _admit(backend: GuidedBackend, params: StructuredOutputsParams, compiles: Optional[CompileService]):
    """:func:`admit`, in ``compiles``' worker under its timeout when given (generation's limit and message)."""
    if compiles is None:
        return admit(backend, params)
    key = next(_KEYS)
    compiles.submit(key, lambda: admit(backend, params))
    while True:
        for done_key, result, error in compiles.collect():
            assert done_key == key, f"a guide check collected another job's result: {done_key!r}"
            if error is not None:
                raise error
            return result
        compiles.wait()


def check_guide(backend: GuidedBackend, structured_output: Any, default_json_whitespace: str = "bounded",
                compiles: Optional[CompileService] = None) -> Dict[str, Any]:
    """Admit ``structured_output`` as generation would, and report why (see the module docstring).

    Parameters
    ----------
    backend : GuidedBackend
        The engine's backend (an ``AutoBackend`` under ``auto``); admission
        compiles into its cache, so a later request with this guide finds it compiled.
    structured_output : dict
        A request line's ``structured_output`` object (the server's
        ``response_format`` / ``tools`` turned into one by its protocol).
    default_json_whitespace : str
        The engine's ``--json-whitespace`` (reported for JSON guides).
    compiles : CompileService, optional
        Admission runs in its worker under its timeout (``--grammar-compile-timeout``),
        as generation's does, so a guide too slow to compile is refused here too with
        generation's message.  One caller at a time (its results are collected here).

    Returns
    -------
    dict
        ``{"admitted", "error", "reasons": [{"pointer", "keyword", "message", "backend"?}],
        "guide_type", "guide_hash", "strict", "json_whitespace", "backend", "compile_time_s",
        "keywords": {backend: {"enforced", "checked_after_generation", "refused", "annotations", "unknown"}}}``;
        ``error`` is the message generation would fail the request with (None when admitted);
        ``keywords`` (JSON guides and regexes) has the backend that runs it, or each backend
        tried when refused.
        Never raises for a bad guide.
    """
    report: Dict[str, Any] = {"admitted": False, "error": None, "reasons": [], "guide_type": None,
                              "guide_hash": None, "strict": None, "json_whitespace": None, "backend": None,
                              "compile_time_s": None, "keywords": None}
    try:
        params = StructuredOutputsParams.from_request(structured_output)
        if params is None:
            raise ValueError("no guide: structured_output is null")
    except (ValueError, TypeError) as exc:
        report["error"] = str(exc)
        schema = structured_output.get("json") if isinstance(structured_output, dict) else None
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                schema = None
        reasons = _unsatisfiable_reasons(schema) if isinstance(schema, (dict, bool)) else []
        report["reasons"] = reasons or [{"pointer": "", "keyword": None, "message": str(exc)}]
        return report
    schema = _schema_of(params)
    report.update(guide_type=params.guide_type, guide_hash=guide_hash(params), strict=params.strict,
                  json_whitespace=params.json_whitespace_or(default_json_whitespace))
    start = time.perf_counter()
    try:
        chosen, _ = _admit(backend, params, compiles)
    except ValueError as exc:  # GuideRefused or a compile error: generation's message, word for word
        report["compile_time_s"] = time.perf_counter() - start
        report["error"] = str(exc)
        report["reasons"] = _refusal_reasons(backend, params, schema, str(exc))
        if schema is not None:
            names = list(getattr(backend, "backends", {backend.name: backend}))
            report["keywords"] = {name: _keyword_table(schema, name, params.strict) for name in names}
        return report
    report.update(admitted=True, backend=chosen, compile_time_s=time.perf_counter() - start)
    if schema is not None:
        report["keywords"] = {chosen: _keyword_table(schema, chosen, params.strict)}
    return report


def _refusal_reasons(backend: GuidedBackend, params: StructuredOutputsParams, schema: Any,
                     message: str) -> List[Dict[str, Any]]:
    """Each backend's unenforced keyword uses with their pointers, else the backend's whole message."""
    reasons: List[Dict[str, Any]] = []
    names = list(getattr(backend, "backends", {backend.name: backend}))
    if schema is not None and params.strict:
        for name in names:
            for pointer, why in unenforced_keywords(schema, name) + not_compiled_keywords(schema, name):
                if params.guide_type == "regex":
                    pointer, why = "", why.replace("'pattern", "'regex")
                reasons.append({"pointer": pointer, "keyword": "regex" if params.guide_type == "regex"
                                else _last_keyword(pointer), "message": why, "backend": name})
    return reasons or [{"pointer": "", "keyword": None, "message": message}]
