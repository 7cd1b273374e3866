"""Whitespace allowed between JSON tokens: ``compact``, ``bounded`` (default) or ``any``.

A model may emit whitespace forever inside a JSON value when the grammar
allows any amount (``"any"``, vLLM's and the backends' default): the request
ends with ``"length"`` and no value.  ``"bounded"`` allows at most
:data:`MAX_BOUNDED_WHITESPACE` consecutive whitespace characters between
tokens (a newline plus indentation), ``"compact"`` none.  Each mode is
expressed with the backend's own options:

=========  ===========================================  ===========================================
mode       xgrammar ``compile_json_schema``             llguidance ``JsonCompileOptions``
=========  ===========================================  ===========================================
compact    ``any_whitespace=False``,                    ``whitespace_flexible=False``
           ``separators=(",", ":")``                    (separators ``,`` and ``:``)
bounded    ``any_whitespace=True``,                     ``whitespace_flexible=True``,
           ``max_whitespace_cnt=12``                    ``whitespace_pattern=[ \\n\\r\\t]{0,12}``
any        ``any_whitespace=True``                      ``whitespace_flexible=True``
=========  ===========================================  ===========================================
"""

from __future__ import annotations

from typing import Any, Dict

#: Accepted values of ``--json-whitespace`` and of a request's ``json_whitespace``.
WHITESPACE_MODES = ("compact", "bounded", "any")

#: Default mode of the engine and the backends.
DEFAULT_JSON_WHITESPACE = "bounded"

#: Most consecutive whitespace characters between two JSON tokens in ``"bounded"`` mode.
MAX_BOUNDED_WHITESPACE = 12


def check_whitespace_mode(mode: Any, name: str = "json_whitespace") -> str:
    """``mode`` if it is one of :data:`WHITESPACE_MODES`, else ``ValueError`` naming both."""
    if mode not in WHITESPACE_MODES:
        raise ValueError(f"{name} must be one of {list(WHITESPACE_MODES)}, got {mode!r}")
    return mode


def xgrammar_json_options(mode: str) -> Dict[str, Any]:
    """Keyword arguments of ``xgrammar.GrammarCompiler.compile_json_schema`` for ``mode``."""
    check_whitespace_mode(mode)
    if mode == "compact":
        return {"any_whitespace": False, "separators": (",", ":")}
    if mode == "bounded":
        return {"any_whitespace": True, "max_whitespace_cnt": MAX_BOUNDED_WHITESPACE}
    return {"any_whitespace": True}


def llguidance_json_options(mode: str) -> Dict[str, Any]:
    """llguidance ``JsonCompileOptions`` (the ``defaults`` of ``grammar_from_json_schema``) for ``mode``."""
    check_whitespace_mode(mode)
    # coerce_one_of: compile oneOf as anyOf, which admission allows only where the branches are
    # disjoint (tpguide.guided.disjoint); any other oneOf is refused before compilation
    if mode == "compact":
        return {"whitespace_flexible": False, "coerce_one_of": True}
    if mode == "bounded":
        return {"whitespace_flexible": True, "coerce_one_of": True,
                "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,%d}" % MAX_BOUNDED_WHITESPACE}
    return {"whitespace_flexible": True, "coerce_one_of": True}
