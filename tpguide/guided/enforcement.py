"""What each grammar backend enforces, measured keyword by keyword, and the checked-in result.

For each :class:`~tpguide.guided.keyword_cases.KeywordCase` the backend
compiles the case's schema and a fresh matcher is fed the tokens of the valid
instance, then of the invalid one, each followed by a stop token
(:func:`measure_case`).  The outcome is one of:

=================  ============================================================
``enforced``       valid instance accepted, invalid one rejected
``NOT enforced``   the invalid instance is accepted: the keyword is ignored
``refused``        the backend does not compile the schema (fails closed)
``over-strict``    the valid instance is rejected too (never an invalid
                   output, but some valid ones cannot be produced)
=================  ============================================================

:data:`MEASURED` is the table this produced for the installed xgrammar and
llguidance; ``tests/test_guided_enforcement.py`` measures again and fails when
the two differ (a backend upgrade changed what it enforces) and checks that
docs/guarantees.md prints :func:`format_table`.  Admission
(:mod:`tpguide.guided.admission`) refuses a schema that uses a keyword marked
``NOT enforced`` for the chosen backend.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Iterable

from tpguide.guided.keyword_cases import KEYWORD_CASES, KeywordCase
from tpguide.guided.matcher import GrammarMatcher, GuidedBackend
from tpguide.guided.params import StructuredOutputsParams

ENFORCED, NOT_ENFORCED, REFUSED, OVER_STRICT = "enforced", "NOT enforced", "refused", "over-strict"

#: Backends in table column order.
TABLE_BACKENDS = ("xgrammar", "llguidance")


def matcher_accepts_text(matcher: GrammarMatcher, token_ids: Iterable[int], stop_token_id: int) -> bool:
    """True if ``matcher`` accepts every token of ``token_ids`` and then ``stop_token_id``, ending terminated."""
    for token_id in token_ids:
        if not matcher.accept_token(token_id):
            return False
    return matcher.accept_token(stop_token_id) and matcher.is_terminated()


def measure_case(backend: GuidedBackend, tokenizer: Any, case: KeywordCase) -> str:
    """Outcome of one case on ``backend`` (one of the four strings in the module docstring)."""
    try:
        compiled = backend.compile(StructuredOutputsParams(json=case.schema))
    except ValueError:
        return REFUSED
    stop = backend.stop_token_ids[0]

    def accepts(instance: Any) -> bool:
        text = json.dumps(instance, separators=(",", ":"), ensure_ascii=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return matcher_accepts_text(backend.matcher(compiled), ids, stop)

    if not accepts(case.valid):
        return OVER_STRICT
    return NOT_ENFORCED if accepts(case.invalid) else ENFORCED


def measure_backend(backend: GuidedBackend, tokenizer: Any) -> Dict[str, str]:
    """``{case key: outcome}`` for every case of :data:`KEYWORD_CASES`, in table order."""
    return {case.key: measure_case(backend, tokenizer, case) for case in KEYWORD_CASES}


def format_table(measured: Dict[str, Dict[str, str]]) -> str:
    """A Markdown table: one row per case key, one column per backend of ``measured``."""
    names = [n for n in TABLE_BACKENDS if n in measured]
    dialects = {case.key: case.dialect for case in KEYWORD_CASES}
    lines = ["| keyword | spelling | " + " | ".join(names) + " |",
             "|---|---|" + "---|" * len(names)]
    for key in measured[names[0]]:
        cells = [measured[n][key] for n in names]
        lines.append(f"| `{key}` | {dialects[key]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def unenforced_keys(backend_name: str) -> frozenset:
    """Case keys :data:`MEASURED` marks ``NOT enforced`` for ``backend_name`` (empty for unknown names)."""
    table = MEASURED.get(backend_name, {})
    return frozenset(k for k, v in table.items() if v == NOT_ENFORCED)


#: Outcomes other than ``enforced``, measured with xgrammar 0.2.9 and llguidance 1.9.1 on the
#: SmolLM2 tokenizer (``tests/test_guided_enforcement.py`` re-measures and compares).
_EXCEPTIONS: Dict[str, Dict[str, str]] = {
    "xgrammar": {
        "multipleOf (number)": NOT_ENFORCED,
        "maxLength (with pattern)": NOT_ENFORCED,
        "minLength (with pattern)": NOT_ENFORCED,
        "maxLength (with format)": NOT_ENFORCED,
        "pattern (lookaround)": NOT_ENFORCED,
        "uniqueItems": NOT_ENFORCED,
        "contains": NOT_ENFORCED,
        "maxContains": NOT_ENFORCED,
        "minContains": NOT_ENFORCED,
        "dependentRequired": NOT_ENFORCED,
        "dependentSchemas": NOT_ENFORCED,
        "patternProperties": OVER_STRICT,
        "allOf": NOT_ENFORCED,
        "oneOf": NOT_ENFORCED,
        "not": NOT_ENFORCED,
        "if/then/else": NOT_ENFORCED,
        "$anchor": NOT_ENFORCED,
        "items (array, draft-07)": REFUSED,
        "additionalItems": REFUSED,
        "dependencies (array)": NOT_ENFORCED,
        "dependencies (schema)": NOT_ENFORCED,
        "exclusiveMaximum (boolean, draft-04)": REFUSED,
        "exclusiveMinimum (boolean, draft-04)": REFUSED,
        "format: idn-email": NOT_ENFORCED,
        "format: idn-hostname": NOT_ENFORCED,
        "format: iri": NOT_ENFORCED,
        "format: regex": NOT_ENFORCED,
    },
    "llguidance": {
        "pattern (lookaround)": REFUSED,
        "uniqueItems": REFUSED,
        "contains": REFUSED,
        "maxContains": REFUSED,
        "minContains": REFUSED,
        "maxProperties": REFUSED,
        "minProperties": REFUSED,
        "dependentRequired": REFUSED,
        "dependentSchemas": REFUSED,
        "propertyNames": REFUSED,
        "unevaluatedProperties": REFUSED,
        "unevaluatedItems": REFUSED,
        "oneOf": NOT_ENFORCED,  # compiled as anyOf (coerce_one_of); disjoint branches are enforced
        "not": REFUSED,
        "if/then/else": REFUSED,
        "dependencies (array)": REFUSED,
        "dependencies (schema)": REFUSED,
        "format: idn-email": REFUSED,
        "format: idn-hostname": REFUSED,
        "format: uri-reference": REFUSED,
        "format: iri": REFUSED,
        "format: uri-template": REFUSED,
        "format: json-pointer": REFUSED,
        "format: relative-json-pointer": REFUSED,
        "format: regex": REFUSED,
    },
}

#: ``{backend: {case key: outcome}}`` for every case of :data:`KEYWORD_CASES`.
MEASURED: Dict[str, Dict[str, str]] = {
    name: {case.key: exceptions.get(case.key, ENFORCED) for case in KEYWORD_CASES}
    for name, exceptions in _EXCEPTIONS.items()
}
