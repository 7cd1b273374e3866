"""Admitting a guide: the one function that tries the backends in order, checks fail closed and compiles (:func:`admit`).

docs/architecture.md §5.  The backends are built by
:func:`~tpguide.guided.backends.make_backend`.  :func:`admit` takes one
backend, or under ``--guided-backend auto`` the backends of an
:class:`~tpguide.guided.auto_backend.AutoBackend` in its order (xgrammar,
then llguidance), and returns the first admission or the refusal; no backend
calls back into admission.  The driver runs :func:`admit` off the step loop
(:mod:`tpguide.guided.compile_service`).

**Fail closed: refuse what the chosen backend cannot guarantee.**  An output
that finishes ``"stop"`` satisfies its constraint, so a request is refused up front (``finish_reason="error"``, a
400 in the server) when:

* its schema uses a keyword the backend does not enforce
  (:data:`~tpguide.guided.enforcement.MEASURED`; a ``format`` nobody measured
  counts as unenforced; xgrammar turns length/count bounds >= 2**31 into
  "unbounded"), :func:`check_enforceable` over the keyword walk of
  :mod:`tpguide.guided.schema_keywords`;
* an object's ``required`` names a property its ``properties`` does not
  declare (neither backend writes one),
  :func:`~tpguide.guided.schema_keywords.undeclared_required`;
* the schema has no instance (:mod:`tpguide.guided.schema_check`, checked when
  the request is parsed);
* the grammar's first mask allows no token (``root ::= root "x"``, the regex
  ``[^\\s\\S]``), :func:`check_first_mask`.

Each message names the keyword or the reason and the JSON pointer.  A request
with ``"strict": false`` skips these checks (best effort); its output is still
validated (:mod:`tpguide.guided.schema_check`).
"""

from __future__ import annotations

import json
from typing import Any, Tuple

from tpguide.guided.auto_backend import AutoBackend
from tpguide.guided.bitmask import allocate_token_bitmask, find_dead_end_rows
from tpguide.guided.matcher import GuidedBackend
from tpguide.guided.params import StructuredOutputsParams
from tpguide.guided.schema_keywords import tag_schemas, unenforced_keywords

__all__ = ["GuideRefused", "admit", "check_enforceable", "check_first_mask"]

# ------------------------------------------------------------------ the fail-closed checks

class GuideRefused(ValueError):
    """A guide the backend cannot guarantee; the message says why and where."""


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
    """Admit ``params``: the first backend, in order, that can guarantee it; ``(its name, compiled)``.

    One backend is tried alone.  Under ``auto`` (an :class:`AutoBackend`)
    the backends of :meth:`AutoBackend.candidates` are tried in order, each
    through the checks and the compile of :func:`_admit_on`; the first that
    passes is recorded in ``backend``'s cache under
    :meth:`~tpguide.guided.matcher.GuidedBackend.cache_key` (which holds
    ``strict``: a best-effort admission never admits a strict request), so
    the same guide is admitted again by a lookup.

    Returns
    -------
    (str, compiled)
        The name of the backend that runs the guide, and what ``backend.matcher``
        takes (under ``auto`` an :class:`~tpguide.guided.auto_backend.AutoCompiled`).

    Raises
    ------
    GuideRefused
        See :func:`check_enforceable` and :func:`check_first_mask`; under
        ``auto``: no backend can guarantee ``params``, the message gives each
        backend's reason (an unavailable one's too).
    ValueError
        One backend: the guide does not compile (the backend's message).
    """
    if not isinstance(backend, AutoBackend):
        return backend.name, _admit_on(backend, params)
    admitted = backend.admitted(params)
    if admitted is not None:
        return admitted.backend_name, admitted
    reasons = [f"{name}: unavailable ({why})" for name, why in backend.unavailable.items()]
    for name, each in backend.candidates(params).items():
        try:
            compiled = _admit_on(each, params)
        except ValueError as exc:
            reasons.append(f"{name}: {exc}")
            continue
        return name, backend.remember(params, name, compiled)
    raise GuideRefused(f"no guided backend can guarantee this {params.guide_type}: " + " | ".join(reasons))


def _admit_on(backend: GuidedBackend, params: StructuredOutputsParams) -> Any:
    """``params`` checked and compiled on one backend (not ``auto``): its compiled form.

    Raises
    ------
    GuideRefused, ValueError
        As :func:`admit` for one backend.
    """
    check_enforceable(params, backend.name)
    compiled = backend.compile(params)
    check_first_mask(backend, compiled, params)
    return compiled
