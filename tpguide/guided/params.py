"""Structured-output parameters of one request and the JSON whitespace modes (docs/architecture.md §5).

The fields follow vLLM's ``StructuredOutputsParams``; exactly one guide is set
per request.  The request line carries them as::

    "structured_output": {"json": {...schema...}}        guide_type "json_schema"
                         {"json_object": true}            guide_type "json" (any JSON object)
                         {"regex": "[0-9]+"}              guide_type "regex"
                         {"choice": ["yes", "no"]}        guide_type "choice"
                         {"grammar": "root ::= ..."}      guide_type "grammar"
                         {"structural_tag": {...}}        guide_type "structural_tag"
                         null                             unguided

Two options may sit beside the guide key (docs/architecture.md §5, fail closed)::

    "strict": false            best effort: run even what cannot be guaranteed (a keyword
                               the backend does not enforce, an unsatisfiable schema, an
                               empty first mask); the output is still validated and a
                               failing one finishes "error" (OpenAI's ``strict: false``)
    "json_whitespace": "any"   per-request override of ``--json-whitespace``
                               (``compact``, ``bounded`` or ``any``; JSON guides only)

Keys whose value is ``null`` count as unset, and ``"json_object": false`` too.
Every validation error is a :class:`ValueError` naming the offending value, so
the engine can fail just that request with a readable reason.

**JSON whitespace** (:func:`check_whitespace_mode`, the backends' options):
``compact``, ``bounded`` (default) or ``any`` between JSON tokens.  A model
may emit whitespace forever inside a JSON value when the grammar allows any
amount (``"any"``, vLLM's and the backends' default): the request ends with
``"length"`` and no value.  ``"bounded"`` allows at most
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

import json as _json
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Union

from tpguide.guided.schema_check import check_schema_has_finite_instance, check_valid_schema_text

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


# ------------------------------------------------------------------ a request's guide

#: Keys accepted in the ``"structured_output"`` object of a request line.
GUIDE_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

#: Guide types a backend may see, in the order of :data:`GUIDE_KEYS`.
GUIDE_TYPES = ("json_schema", "regex", "choice", "grammar", "json", "structural_tag")

_GUIDE_TYPE_OF_KEY = dict(zip(GUIDE_KEYS, GUIDE_TYPES))

#: Options accepted beside the guide key (each is part of :meth:`StructuredOutputsParams.cache_key`).
OPTION_KEYS = ("strict", "json_whitespace")

#: Guide types that take a whitespace mode.
JSON_GUIDE_TYPES = ("json_schema", "json")

#: The JSON schema that ``json_object`` stands for (vLLM's semantics: any JSON object).
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_object_text(key: str, value: Any) -> str:
    """``value`` (dict or JSON text of an object) as JSON text; ValueError otherwise."""
    if isinstance(value, dict):
        try:
            return _json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{key} is not JSON-serialisable: {exc} (got {_short(value)})") from exc
    if isinstance(value, str):
        try:
            parsed = _json.loads(value)
        except _json.JSONDecodeError as exc:
            raise ValueError(f"{key} is not valid JSON: {exc} (got {_short(value)})") from exc
        if not isinstance(parsed, dict):
            raise ValueError(f"{key} must be a JSON object, got {type(parsed).__name__}: {_short(value)}")
        return value
    raise ValueError(f"{key} must be a dict or a JSON string, got {type(value).__name__}: {_short(value)}")


@dataclass(frozen=True, eq=False)
class StructuredOutputsParams:
    """One request's guide; exactly one field is set.

    Attributes
    ----------
    json : dict or str, optional
        A JSON schema (dict or its JSON text).  ``guide_type == "json_schema"``.
    regex : str, optional
        A regular expression the whole output must match.
    choice : tuple of str, optional
        The output is exactly one of these strings (a list is accepted and
        stored as a tuple).
    grammar : str, optional
        A context-free grammar: GBNF/EBNF for xgrammar, Lark for llguidance.
    json_object : bool, optional
        ``True``: any JSON object (``guide_type == "json"``).
    structural_tag : dict or str, optional
        A structural tag (xgrammar's format; see the backends for what each supports).
    strict : bool
        True (default): refuse what cannot be guaranteed (a schema with no
        instance here; unenforced keywords and empty first masks at
        admission).  False: best effort, the output is validated only.
    json_whitespace : {None, "compact", "bounded", "any"}
        Whitespace between JSON tokens; None = the engine's ``--json-whitespace``.

    Raises
    ------
    ValueError
        No guide or several guides set, a wrong type, an empty choice list or
        string, JSON text that does not parse to an object, a schema with no
        instance (strict only), a bad option value.

    Notes
    -----
    Equality and hashing go through :meth:`cache_key`, so params holding a
    schema dict are hashable, and params that differ in ``strict`` or
    ``json_whitespace`` are different params.
    """

    json: Optional[Union[dict, str]] = None
    regex: Optional[str] = None
    choice: Optional[tuple] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[Union[dict, str]] = None
    strict: bool = True
    json_whitespace: Optional[str] = None
    _text: str = field(init=False, repr=False, compare=False, default="")

    def __post_init__(self) -> None:
        set_keys = [k for k in GUIDE_KEYS if self._is_set(k)]
        if not set_keys:
            raise ValueError(f"no guide set: set exactly one of {list(GUIDE_KEYS)}")
        if len(set_keys) > 1:
            shown = ", ".join(f"{k}={_short(getattr(self, k), 40)}" for k in set_keys)
            raise ValueError(f"exactly one guide may be set, got {len(set_keys)}: {shown}")
        if not isinstance(self.strict, bool):
            raise ValueError(f"strict must be true or false, got {_short(self.strict)}")
        if self.json_whitespace is not None:
            check_whitespace_mode(self.json_whitespace)
        object.__setattr__(self, "_text", self._validate(set_keys[0]))
        if self.json_whitespace is not None and set_keys[0] not in ("json", "json_object"):
            raise ValueError(f"json_whitespace applies to JSON guides only, got it with {set_keys[0]!r}")

    def _is_set(self, key: str) -> bool:
        value = getattr(self, key)
        return value is not None and not (key == "json_object" and value is False)

    def _validate(self, key: str) -> str:
        """Check the set field and return its canonical text (what backends compile)."""
        value = getattr(self, key)
        if key == "json":
            text = _json_object_text("json", value)
            if self.strict:
                schema = _json.loads(text)
                check_schema_has_finite_instance(schema)  # first: its reason names the unsatisfiable part
                check_valid_schema_text(text)
            return text
        if key == "structural_tag":
            return _json_object_text("structural_tag", value)
        if key == "json_object":
            if value is not True:
                raise ValueError(f"json_object must be true or false, got {_short(value)}")
            return JSON_OBJECT_SCHEMA
        if key in ("regex", "grammar"):
            if not isinstance(value, str):
                raise ValueError(f"{key} must be a string, got {type(value).__name__}: {_short(value)}")
            if not value:
                raise ValueError(f"{key} must be a non-empty string, got ''")
            if "\x00" in value:
                raise ValueError(f"{key} must not contain a NUL character, got {_short(value)}")
            return value
        # choice
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ValueError(f"choice must be a list of strings, got {type(value).__name__}: {_short(value)}")
        if not value:
            raise ValueError("choice must be a non-empty list of strings, got []")
        bad = [c for c in value if not isinstance(c, str) or not c or "\x00" in c]
        if bad:
            raise ValueError(
                f"choice entries must be non-empty strings without NUL, got {_short(bad)} in {_short(value)}"
            )
        object.__setattr__(self, "choice", tuple(value))
        return _json.dumps(list(value), ensure_ascii=False)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StructuredOutputsParams):
            return NotImplemented
        return self.cache_key() == other.cache_key()

    def __hash__(self) -> int:
        return hash(self.cache_key())

    @property
    def guide_key(self) -> str:
        """The field that is set (one of :data:`GUIDE_KEYS`)."""
        return next(k for k in GUIDE_KEYS if self._is_set(k))

    @property
    def guide_type(self) -> str:
        """``"json_schema"``, ``"json"``, ``"regex"``, ``"choice"``, ``"grammar"`` or ``"structural_tag"``."""
        return _GUIDE_TYPE_OF_KEY[self.guide_key]

    @property
    def guide_text(self) -> str:
        """Canonical text of the guide: schema/tag JSON, regex, grammar, or the choices as a JSON list.

        ``json_object`` gives :data:`JSON_OBJECT_SCHEMA`.  A dict schema keeps its
        key order (property order shapes the generated output).
        """
        return self._text

    def json_whitespace_or(self, default: Optional[str]) -> Optional[str]:
        """The whitespace mode this guide compiles with: its ``json_whitespace``, else ``default``.

        None for a guide that is not JSON (``json_schema`` or ``json``), which
        has no whitespace mode.
        """
        if self.guide_type not in JSON_GUIDE_TYPES:
            return None
        return self.json_whitespace or default

    def cache_key(self, default_json_whitespace: Optional[str] = None) -> tuple:
        """Hashable key of everything in the request that changes admission or compilation.

        ``(guide_type, guide_text, ("strict", strict), ("json_whitespace", mode))``: one
        ``(name, value)`` pair per option of :data:`OPTION_KEYS`, so a new
        per-request option joins the key.  ``strict`` changes admission (a
        best-effort admission must never stand for a strict one), the whitespace
        mode the compiled grammar.  ``mode`` is :meth:`json_whitespace_or` of
        ``default_json_whitespace``: a backend passes its own default
        (:meth:`~tpguide.guided.matcher.GuidedBackend.cache_key` prepends its name),
        so a request that leaves the mode unset and one that names the same mode
        share an entry.  docs/architecture.md §5.
        """
        options = {name: getattr(self, name) for name in OPTION_KEYS}
        options["json_whitespace"] = self.json_whitespace_or(default_json_whitespace)
        return (self.guide_type, self._text) + tuple(options.items())

    @classmethod
    def from_request(cls, obj: Optional[dict]) -> Optional["StructuredOutputsParams"]:
        """Parse the ``"structured_output"`` field of a request line.

        Parameters
        ----------
        obj : dict or None
            ``None`` means unguided.

        Returns
        -------
        StructuredOutputsParams or None

        Raises
        ------
        ValueError
            ``obj`` is not an object, has keys other than :data:`GUIDE_KEYS`
            (the error names them and the allowed ones), or fails validation.
        """
        if obj is None:
            return None
        if not isinstance(obj, dict):
            raise ValueError(
                f"structured_output must be an object or null, got {type(obj).__name__}: {_short(obj)}"
            )
        unknown = sorted(set(obj) - set(GUIDE_KEYS) - set(OPTION_KEYS), key=str)
        if unknown:
            raise ValueError(
                f"unknown structured_output keys {unknown}; allowed keys are {list(GUIDE_KEYS)} "
                f"and the options {list(OPTION_KEYS)}"
            )
        options = {k: obj[k] for k in OPTION_KEYS if obj.get(k) is not None}
        return cls(**{k: v for k, v in obj.items() if k in GUIDE_KEYS}, **options)
