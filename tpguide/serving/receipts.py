"""Receipts in server answers, and the guide check endpoint's work (docs/receipts.md, docs/serving.md).

A request with ``"return_receipt": true`` (or every request, with
``--return-receipts``) gets each choice's receipt: in the choice of a
non-streamed answer, and in the last chunk of each streamed choice (the one
with its ``finish_reason``).  The server adds the tool setup to the guide
section (``guide.tools``: the call format and ``tool_choice``), which a request
line does not carry.

:func:`check_guides` serves ``POST /v1/guides/check``: each guide of the body
is turned into a request line's ``structured_output`` by the request parser
that generation uses (:func:`~tpguide.serving.protocol.parse_request`:
``response_format``, ``structured_outputs``, the legacy ``guided_*`` fields,
``tools`` + ``tool_choice``), then admitted by the engine's own admission
(:func:`~tpguide.guided.guide_check.check_guide`).
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional

from tpguide.serving.errors import APIError, bad_request

__all__ = ["GUIDE_FIELDS", "check_guides", "receipt_of", "wants_receipt"]

#: Body fields of a chat request that define its guide (what ``/v1/guides/check`` reads).
GUIDE_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar", "tools", "tool_choice", "parallel_tool_calls")


def wants_receipt(body: Dict[str, Any], always: bool) -> bool:
    """Whether the answer carries receipts: ``always`` (``--return-receipts``) or ``return_receipt: true``.

    Raises
    ------
    APIError
        400 when ``return_receipt`` is not a boolean.
    """
    value = body.get("return_receipt", False)
    if not isinstance(value, bool):
        raise bad_request(f"return_receipt must be true or false, got {value!r}", "return_receipt")
    return always or value


def receipt_of(out: Any, tools: Any) -> Optional[Dict[str, Any]]:
    """``out``'s receipt with the server's tool setup in ``guide.tools`` (None when it has none)."""
    receipt = getattr(out, "receipt", None)
    if receipt is None:
        return None
    if tools is not None and receipt.get("guide") is not None:
        receipt = copy.copy(receipt)
        receipt["guide"] = {**receipt["guide"], "tools": {
            "format": tools.fmt.name, "tool_choice": tools.mode, "functions": [t.name for t in tools.tools],
            "parallel_tool_calls": tools.parallel}}
    return receipt


def check_guides(body: Any, check: Callable[[Any], Dict[str, Any]], parse: Callable[[Dict[str, Any]], Any]
                 ) -> Dict[str, Any]:
    """The answer of ``POST /v1/guides/check``: one report per guide, in order.

    Parameters
    ----------
    body : dict
        Either one request's guide fields (:data:`GUIDE_FIELDS`), or
        ``{"guides": [fields, ...]}``.
    check : callable
        ``structured_output -> report`` (:func:`~tpguide.guided.guide_check.check_guide` on the engine's backend).
    parse : callable
        ``chat body -> ParsedRequest``: the server's request parser.

    Raises
    ------
    APIError
        400 when the body is not an object, ``guides`` is not a non-empty
        list of objects, or a guide has a field other than :data:`GUIDE_FIELDS`.
    """
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, got {type(body).__name__}")
    guides = body["guides"] if "guides" in body else [body]
    if not isinstance(guides, list) or not guides or not all(isinstance(g, dict) for g in guides):
        raise bad_request("'guides' must be a non-empty list of objects", "guides")
    reports: List[Dict[str, Any]] = []
    for i, fields in enumerate(guides):
        unknown = sorted(set(fields) - set(GUIDE_FIELDS) - ({"guides"} if fields is body else set()))
        if unknown:
            raise bad_request(f"guides[{i}] has field(s) {unknown} a guide check does not read; allowed: "
                              f"{list(GUIDE_FIELDS)}", f"guides[{i}].{unknown[0]}")
        try:
            parsed = parse({"model": "", "messages": [{"role": "user", "content": "-"}], **fields})
        except APIError as err:  # a malformed guide: refused with the parser's message, as generation would
            reports.append({"admitted": False, "error": err.message, "reasons": [
                {"pointer": "", "keyword": None, "message": err.message}]})
            continue
        so = parsed.lines[0].get("structured_output")
        if so is None:
            reports.append({"admitted": False, "error": "no guide in this entry (set one of "
                                                        f"{list(GUIDE_FIELDS[:6])} or tools)", "reasons": []})
            continue
        report = check(so)
        if parsed.tools is not None:
            report["tools"] = {"format": parsed.tools.fmt.name, "tool_choice": parsed.tools.mode}
        reports.append(report)
    return {"object": "list", "data": reports}
