"""jsonschema imported without ``rfc3987_syntax`` (1.4 s of Lark grammars): its IRI checks load it on first use.

docs/benchmarks.md "Fresh-process start-up on CPU".  ``jsonschema._format``
runs ``from rfc3987_syntax import is_valid_syntax`` at import to register the
``iri`` and ``iri-reference`` format checkers, and ``rfc3987_syntax`` builds
39 Earley parsers at its own import: about 1.4 s of one core (2-core AMD
EPYC), on the engine's start-up path, for a check that only a schema with
``"format": "iri"`` ever runs.  :func:`import_jsonschema_lazily` lets
jsonschema import a stand-in whose ``is_valid_syntax`` imports the real module
on its first call and delegates to it, so the checkers and their results are
unchanged.  The stand-in is in ``sys.modules`` only during jsonschema's import.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types

__all__ = ["import_jsonschema_lazily"]

_NAME = "rfc3987_syntax"


class _DeferredIriSyntax(types.ModuleType):
    """Stands in for ``rfc3987_syntax`` while jsonschema imports; any use loads the real module."""

    def __init__(self) -> None:
        super().__init__(_NAME, f"stand-in for {_NAME}, imported on first use (tpguide.guided.lazy_iri_syntax)")
        self._lock = threading.Lock()
        self._real = None

    def _module(self) -> types.ModuleType:
        with self._lock:
            if self._real is None:
                self._real = importlib.import_module(_NAME)
            return self._real

    def is_valid_syntax(self, term: str, value: str) -> bool:
        """``rfc3987_syntax.is_valid_syntax(term, value)`` (the real module is imported on the first call)."""
        return self._module().is_valid_syntax(term, value)

    def __getattr__(self, name: str):
        if name.startswith("__"):  # the import system's probes (``__path__``) must not load the module
            raise AttributeError(name)
        return getattr(self._module(), name)  # a name jsonschema did not use before: the real one


def import_jsonschema_lazily() -> types.ModuleType:
    """:mod:`jsonschema`, imported with the stand-in for ``rfc3987_syntax`` when it is installed and not loaded.

    Where ``rfc3987_syntax`` is absent, already imported, or jsonschema is
    already imported, this is a plain ``import jsonschema``.
    """
    if "jsonschema" not in sys.modules and _NAME not in sys.modules and importlib.util.find_spec(_NAME) is not None:
        sys.modules[_NAME] = _DeferredIriSyntax()
        try:
            import jsonschema
        finally:
            if isinstance(sys.modules.get(_NAME), _DeferredIriSyntax):
                del sys.modules[_NAME]
    import jsonschema

    return jsonschema
