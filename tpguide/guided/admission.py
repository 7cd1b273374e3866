"""Admitting a guide: the backend that can guarantee it, checked fail closed, then compiled.

docs/architecture.md §5.  In order: :func:`make_backend` (``xgrammar``,
``llguidance`` or ``auto``), the fail-closed checks and :func:`admit`,
:class:`AutoBackend` (``--guided-backend auto``).  The driver runs
:func:`admit` off the step loop (:mod:`tpguide.guided.compile_service`).

**Fail closed: refuse what the chosen backend cannot guarantee.**  An output
that finishes ``"stop"`` satisfies its constraint, so a request is refused up front (``finish_reason="error"``, a
400 in the server) when:

* its schema uses a keyword the backend does not enforce
  (:data:`~tpguide.guided.enforcement.MEASURED`; a ``format`` nobody measured
  counts as unenforced; xgrammar turns length/count bounds >= 2**31 into
  "unbounded"), :func:`check_enforceable`;
* the schema has no instance (:mod:`tpguide.guided.schema_check`, checked when
  the request is parsed);
* the grammar's first mask allows no token (``root ::= root "x"``, the regex
  ``[^\\s\\S]``), :func:`check_first_mask`.

Each message names the keyword or the reason and the JSON pointer.  A request
with ``"strict": false`` skips these checks (best effort); its output is still
validated (:mod:`tpguide.guided.schema_check`).  :func:`admit` runs the
checks and the compilation for one backend; :class:`AutoBackend` runs it for
xgrammar, then llguidance.

**``--guided-backend auto``: per request, the first backend that can
guarantee the guide.**  Order: xgrammar (precomputed masks, the faster matcher), then llguidance.  A
backend is taken when it enforces every keyword the schema uses, compiles the
guide, and its first mask allows a token (:func:`admit`).
If neither can, the request is refused with both reasons.  The choice is a
pure function of the guide, its options (``strict``, the whitespace mode) and
the installed backends, so every run makes the same one; it is cached under
:meth:`~tpguide.guided.matcher.GuidedBackend.cache_key`, which holds them all.
Only the driver chooses (the other ranks never see grammars).  The output
line names the backend that ran (``"guided_backend"``).

A ``grammar`` guide goes by its syntax, not by trial: GBNF (it has ``::=``)
only to xgrammar, Lark only to llguidance, so a GBNF syntax error is
reported as such and never reinterpreted by the other parser.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from tpguide.guided.bitmask import allocate_token_bitmask, find_dead_end_rows
from tpguide.guided.enforcement import unenforced_keys
from tpguide.guided.keyword_cases import FORMAT_EXAMPLES, keyword_key
from tpguide.guided.matcher import GrammarMatcher, GuidedBackend
from tpguide.guided.params import StructuredOutputsParams

#: Names accepted by :func:`make_backend`.
BACKENDS = ("auto", "xgrammar", "llguidance")


def make_backend(
    name: str, tokenizer: Any, padded_vocab_size: int, stop_token_ids: list, **kwargs: Any
) -> GuidedBackend:
    """Build a guided-decoding backend for ``tokenizer``.

    Parameters
    ----------
    name : str
        ``"auto"`` (xgrammar or llguidance per request, :class:`AutoBackend`),
        ``"xgrammar"`` or ``"llguidance"``.
    tokenizer : transformers.PreTrainedTokenizerFast
    padded_vocab_size : int
        Bitmask width in tokens.
    stop_token_ids : list of int
        From :func:`~tpguide.guided.matcher.collect_stop_token_ids`.
    **kwargs
        Backend options (``json_whitespace``, ``cache_size``, ...).

    Raises
    ------
    ValueError
        Unknown ``name`` (the message lists :data:`BACKENDS`); a backend that
        cannot use the tokenizer (``auto``: none can).
    """
    if name == "auto":
        backends, unavailable = {}, {}
        for each in AUTO_ORDER:
            options = {k: v for k, v in kwargs.items() if each == "xgrammar" or k != "max_threads"}
            try:
                backends[each] = make_backend(each, tokenizer, padded_vocab_size, stop_token_ids, **options)
            except ValueError as exc:  # e.g. llguidance cannot read the tokenizer: auto goes on without it
                unavailable[each] = str(exc)
        if not backends:
            raise ValueError(f"no guided backend can use this tokenizer: {unavailable}")
        return AutoBackend(backends, unavailable=unavailable)
    if name == "xgrammar":
        from tpguide.guided.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, padded_vocab_size, stop_token_ids, **kwargs)
    if name == "llguidance":
        from tpguide.guided.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, padded_vocab_size, stop_token_ids, **kwargs)
    raise ValueError(f"unknown guided decoding backend {name!r}; choose one of {list(BACKENDS)}")


# ------------------------------------------------------------------ the fail-closed checks

class GuideRefused(ValueError):
    """A guide the backend cannot guarantee; the message says why and where."""


#: Keywords whose value is one subschema / a list of subschemas / a name -> subschema map.
_SCHEMA_VALUED = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
                  "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_LIST_VALUED = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP_VALUED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")

#: Keywords nobody measured that change what validates: refused on every backend.
UNMEASURED_KEYWORDS = frozenset({"$dynamicRef", "$recursiveRef"})

#: Bounds xgrammar stores in 32 bits: at or above this it treats the bound as absent.
XGRAMMAR_BOUND_LIMIT = 2**31
_COUNT_BOUNDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def _escape(part: Any) -> str:
    return str(part).replace("~", "~0").replace("/", "~1")


def schema_keywords(schema: Any, pointer: str = "") -> Iterator[Tuple[str, str, Any, dict]]:
    """Every keyword of ``schema`` and its subschemas: ``(JSON pointer, keyword, value, the schema holding it)``.

    Values of ``const``, ``enum``, ``default`` and ``examples`` are data, not
    schemas, and are not entered.
    """
    if not isinstance(schema, dict):
        return
    for keyword, value in schema.items():
        here = f"{pointer}/{_escape(keyword)}"
        yield here, keyword, value, schema
        if keyword in _SCHEMA_VALUED and isinstance(value, dict):
            yield from schema_keywords(value, here)
        elif keyword in _LIST_VALUED and isinstance(value, list):
            for i, sub in enumerate(value):
                yield from schema_keywords(sub, f"{here}/{i}")
        elif keyword in _MAP_VALUED and isinstance(value, dict):
            for name, sub in value.items():
                yield from schema_keywords(sub, f"{here}/{_escape(name)}")


def unenforced_keywords(schema: Any, backend_name: str) -> List[Tuple[str, str]]:
    """``(JSON pointer, reason)`` for each use in ``schema`` of something ``backend_name`` does not enforce."""
    unenforced = unenforced_keys(backend_name)
    found = []
    for pointer, keyword, value, node in schema_keywords(schema):
        key = keyword_key(keyword, value, node, schema)
        if key in unenforced:
            found.append((pointer, f"{key!r} is not enforced by {backend_name}"))
        elif keyword == "format" and value not in FORMAT_EXAMPLES:
            found.append((pointer, f"format {value!r} is not enforced by any backend"))
        elif keyword in UNMEASURED_KEYWORDS:
            found.append((pointer, f"{keyword!r} is not enforced by any backend"))
        elif (backend_name == "xgrammar" and keyword in _COUNT_BOUNDS and isinstance(value, int)
              and value >= XGRAMMAR_BOUND_LIMIT):
            found.append((pointer, f"{keyword}={value} >= 2**31, which xgrammar treats as no bound"))
    return found


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
    if not params.strict or params.guide_type not in ("json_schema", "regex"):
        return
    if params.guide_type == "regex":  # a regex guide is refused where a schema "pattern" like it would be
        found = [(pointer, why.replace("'pattern", "'regex")) for pointer, why in
                 unenforced_keywords({"type": "string", "pattern": params.regex}, backend_name)]
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
    """Check and compile ``params`` for ``backend``; returns ``(backend name that runs it, compiled)``.

    ``backend`` may be an :class:`AutoBackend`,
    whose ``compile`` chooses the backend and runs these checks itself.

    Raises
    ------
    GuideRefused
        See :func:`check_enforceable` and :func:`check_first_mask`.
    ValueError
        The guide does not compile (the backend's message).
    """
    if getattr(backend, "is_auto", False):
        compiled = backend.compile(params)
        return compiled.backend_name, compiled
    check_enforceable(params, backend.name)
    compiled = backend.compile(params)
    check_first_mask(backend, compiled, params)
    return backend.name, compiled

# ------------------------------------------------------------------ --guided-backend auto

#: Backends :class:`AutoBackend` tries, in order.
AUTO_ORDER = ("xgrammar", "llguidance")


@dataclass(frozen=True)
class AutoCompiled:
    """A guide compiled by the backend :class:`AutoBackend` chose."""

    backend_name: str
    backend: GuidedBackend
    compiled: Any


class AutoBackend(GuidedBackend):
    """Chooses xgrammar or llguidance per guide (see the module docstring).

    Parameters
    ----------
    backends : dict of str to GuidedBackend
        Built for the same tokenizer, ``padded_vocab_size`` and stop ids;
        tried in :data:`AUTO_ORDER`.
    unavailable : dict of str to str, optional
        Backends that could not be built for this tokenizer, with the reason.

    Raises
    ------
    ValueError
        No backend given, or their ``padded_vocab_size`` differ.
    """

    name = "auto"
    is_auto = True

    def __init__(self, backends: Dict[str, GuidedBackend], cache_size: int = 128,
                 unavailable: Optional[Dict[str, str]] = None) -> None:
        if not backends:
            raise ValueError("AutoBackend needs at least one backend")
        sizes = {b.padded_vocab_size for b in backends.values()}
        if len(sizes) != 1:
            raise ValueError(f"backends disagree on padded_vocab_size: {sorted(sizes)}")
        first = next(iter(backends.values()))
        super().__init__(first.padded_vocab_size, first.stop_token_ids, cache_size)
        self.backends = {n: backends[n] for n in AUTO_ORDER if n in backends}
        self.supported_guide_types = frozenset().union(*(b.supported_guide_types for b in backends.values()))
        self.json_whitespace = first.json_whitespace
        #: ``{name: why}`` of backends that could not be built (they are skipped, and named in refusals)
        self.unavailable = dict(unavailable or {})

    def compile(self, params: StructuredOutputsParams) -> AutoCompiled:
        """The first backend's admitted compilation, cached by :meth:`cache_key`.

        The key holds ``strict``: an entry is an admission, and one made best
        effort (``strict: false`` skips the fail-closed checks) must never
        admit a strict request for the same guide.

        Raises
        ------
        GuideRefused
            No backend can guarantee ``params``; the message gives each backend's reason.
        """
        key = self.cache_key(params)  # the key is_cached() looks up
        cached = self._lookup(key)
        if cached is not None:
            return cached
        reasons = [f"{name}: unavailable ({why})" for name, why in self.unavailable.items()]
        for name, backend in self._candidates(params).items():
            try:
                _, compiled = admit(backend, params)
            except ValueError as exc:
                reasons.append(f"{name}: {exc}")
                continue
            result = AutoCompiled(name, backend, compiled)
            self._remember(key, result)
            return result
        raise GuideRefused(f"no guided backend can guarantee this {params.guide_type}: " + " | ".join(reasons))

    def _candidates(self, params: StructuredOutputsParams) -> Dict[str, GuidedBackend]:
        """Backends to try for ``params``, in order (a grammar by its syntax, see the module docstring)."""
        if params.guide_type != "grammar":
            return self.backends
        wanted = "xgrammar" if "::=" in params.grammar else "llguidance"
        return {n: b for n, b in self.backends.items() if n == wanted}

    def _compile(self, guide_type: str, guide_text: str, **options: Any) -> Any:  # pragma: no cover
        raise NotImplementedError("AutoBackend compiles through compile()")

    def matcher(self, compiled: AutoCompiled) -> GrammarMatcher:
        return compiled.backend.matcher(compiled.compiled)
