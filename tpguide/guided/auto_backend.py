"""``--guided-backend auto``: per request, the first backend that can guarantee the guide (:class:`AutoBackend`).

docs/architecture.md §5.  Order: xgrammar (precomputed masks, the faster matcher), then llguidance.  A
backend is taken when it enforces every keyword the schema uses, compiles the
guide, and its first mask allows a token (:func:`~tpguide.guided.admission.admit`).
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

from dataclasses import dataclass
from typing import Any, Dict, Optional

from tpguide.guided.admission import GuideRefused, admit
from tpguide.guided.matcher import GrammarMatcher, GuidedBackend
from tpguide.guided.params import StructuredOutputsParams

__all__ = ["AUTO_ORDER", "AutoBackend", "AutoCompiled"]


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
        cached = self._cache.get(key)
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
            self._cache.put(key, result)
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
