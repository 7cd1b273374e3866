"""Tools and a JSON-schema answer in one request: one guide, "tool calls OR the schema" (docs/tool-calls.md).

An agent with tools and a structured final answer (openai-agents' ``output_type``)
sends ``tools`` and ``response_format`` / ``text.format`` together, with
``tool_choice`` absent or ``"auto"``.  The output is then either

* tool calls only, as ``tool_choice: "required"`` writes them (the format's
  trigger opens them), or
* one JSON value valid for the schema (the final answer),

under one structural tag ``{"type": "or", "elements": [schema, calls]}``
(xgrammar; llguidance gets the same tag as Lark).  The decoder picks the
branch from the first tokens (``{`` for the answer, the trigger for calls);
a format whose calls are bare JSON objects (``llama3_json``) is ambiguous
with an object answer, and the output is read as calls when it parses as
calls.  Fail closed: a finished output that is not calls must validate
against the schema (:func:`answer_error`).  With ``tool_choice`` required or
named the output is calls only, so the schema never applies and the tools'
guide alone is used.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional

from tpguide.guided.params import check_whitespace_mode
from tpguide.serving.tool_formats.guide import MAX_WHITESPACE, plan_structural_tag
from tpguide.serving.tool_formats.lark import structural_tag_to_lark

#: The schema of a ``json_object`` answer.
ANY_OBJECT: Dict[str, Any] = {"type": "object"}


def answer_or_calls_tag(plan: Any, schema: Dict[str, Any]) -> Dict[str, Any]:
    """The structural tag: one JSON value valid for ``schema``, or the calls of ``plan`` (``ToolPlan``, auto).

    Raises
    ------
    ValueError
        ``plan.mode`` is not ``"auto"`` (required / named never answer in the schema).
    """
    if plan.mode != "auto":
        raise ValueError(f"a schema answer or calls needs tool_choice 'auto', got {plan.mode!r}")
    calls = plan_structural_tag(plan.fmt, "required", plan.tools, plan.parallel, plan.whitespace)["format"]
    answer: Dict[str, Any] = {"type": "json_schema", "json_schema": schema}
    most = MAX_WHITESPACE[check_whitespace_mode(plan.whitespace)]
    if most is not None:
        answer["max_whitespace_cnt"] = most
    return {"type": "structural_tag", "format": {"type": "or", "elements": [answer, calls]}}


def answer_or_calls_guide(plan: Any, schema: Dict[str, Any], backend: str) -> Dict[str, Any]:
    """The request line's ``structured_output``: the tag (xgrammar) or its Lark form (llguidance)."""
    tag = answer_or_calls_tag(plan, schema)
    if backend == "llguidance":
        return {"grammar": structural_tag_to_lark(tag)}
    return {"structural_tag": tag}


def answer_error(text: str, schema: Dict[str, Any]) -> Optional[str]:
    """Why ``text`` (an output without calls) is not a JSON value valid for ``schema``, or None."""
    from tpguide.guided.schema_check import validator_for_schema

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"the answer is neither tool calls nor JSON ({exc}): {text[:80]!r}"
    error = next(iter(validator_for_schema(schema).iter_errors(value)), None)
    if error is not None:
        return f"the answer fails its response_format schema: {error.message}"
    return None
