"""Building a guided-decoding backend by name: ``xgrammar``, ``llguidance`` or ``auto`` (:func:`make_backend`).

docs/architecture.md §5.  A backend is built once per tokenizer, with the
bitmask width and the model's stop ids
(:func:`~tpguide.model.tokenizer_facts.collect_stop_token_ids`).
"""

from __future__ import annotations

from typing import Any

from tpguide.guided.auto_backend import AUTO_ORDER, AutoBackend
from tpguide.guided.matcher import GuidedBackend

__all__ = ["BACKENDS", "make_backend"]

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
        From :func:`~tpguide.model.tokenizer_facts.collect_stop_token_ids`.
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
