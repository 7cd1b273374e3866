"""``--guided-backend auto``: xgrammar and llguidance behind one name, matchers from the backend that admitted the guide.

docs/architecture.md §5.  :class:`AutoBackend` holds the backends, the
order they are tried in (:meth:`AutoBackend.candidates`: xgrammar, with
precomputed masks and the faster matcher, then llguidance), the admitted
guides (its cache) and the matcher dispatch.  It does not admit:
:func:`~tpguide.guided.admission.admit` tries the candidates in order and
takes the first that enforces every keyword the schema uses, compiles the
guide, and whose first mask allows a token; if none can, the request is
refused with each reason.  The choice is a pure function of the guide, its
options (``strict``, the whitespace mode) and the installed backends, so
every run makes the same one; it is cached under
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

from tpguide.guided.matcher import GrammarMatcher, GuidedBackend
from tpguide.guided.params import StructuredOutputsParams

__all__ = ["AUTO_ORDER", "AutoBackend", "AutoCompiled"]


#: Backends :class:`AutoBackend` tries, in order.
AUTO_ORDER = ("xgrammar", "llguidance")


@dataclass(frozen=True)
class AutoCompiled:
    """A guide admitted under ``auto``: the backend that runs it and its compiled form there."""

    backend_name: str
    backend: GuidedBackend
    compiled: Any


class AutoBackend(GuidedBackend):
    """xgrammar and llguidance behind one name (see the module docstring).

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

    def candidates(self, params: StructuredOutputsParams) -> Dict[str, GuidedBackend]:
        """Backends to try for ``params``, in order (a grammar by its syntax, see the module docstring)."""
        if params.guide_type != "grammar":
            return self.backends
        wanted = "xgrammar" if "::=" in params.grammar else "llguidance"
        return {n: b for n, b in self.backends.items() if n == wanted}

    def admitted(self, params: StructuredOutputsParams) -> Optional[AutoCompiled]:
        """``params``' admission, if it is in the cache (the key :meth:`is_cached` looks up)."""
        return self._cache.get(self.cache_key(params))

    def remember(self, params: StructuredOutputsParams, name: str, compiled: Any) -> AutoCompiled:
        """Record that backend ``name`` admitted ``params`` as ``compiled``; the cached :class:`AutoCompiled`."""
        admitted = AutoCompiled(name, self.backends[name], compiled)
        self._cache.put(self.cache_key(params), admitted)
        return admitted

    def compile(self, params: StructuredOutputsParams) -> AutoCompiled:
        """``params``' admission from the cache: ``auto`` compiles only through admission.

        Raises
        ------
        ValueError
            ``params`` was not admitted (or its entry left the cache): admit it
            with :func:`tpguide.guided.admission.admit` and use what that returns.
        """
        admitted = self.admitted(params)
        if admitted is None:
            raise ValueError(f"this {params.guide_type} is not admitted under auto (or its entry left the cache): "
                             f"admit it with tpguide.guided.admission.admit and match what that returns")
        return admitted

    def _compile(self, guide_type: str, guide_text: str, **options: Any) -> Any:  # pragma: no cover
        raise NotImplementedError("auto compiles through admission (tpguide.guided.admission.admit)")

    def matcher(self, compiled: AutoCompiled) -> GrammarMatcher:
        """A fresh matcher of the backend that admitted the guide."""
        return compiled.backend.matcher(compiled.compiled)
