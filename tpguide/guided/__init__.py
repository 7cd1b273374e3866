"""Grammar-guided decoding on the driver (docs/architecture.md §5).

``params`` parses a request's guide, ``make_backend`` builds the xgrammar
(default) or llguidance compiler for the tokenizer, ``GuidedDecoder`` keeps
one matcher per slot and fills the bitmask, ``bitmask`` holds the dead-end
check and the per-rank split.  The backends are imported lazily, so each is
only needed when chosen.
"""

from __future__ import annotations

from typing import Any

from tpguide.guided.bitmask import (
    GuidedDecoder,
    allocate_token_bitmask,
    find_dead_end_rows,
    split_bitmask,
    token_ids_to_bitmask_row,
    unpack_bitmask,
)
from tpguide.guided.matcher import GrammarMatcher, GuidedBackend, collect_stop_token_ids
from tpguide.guided.params import GUIDE_KEYS, GUIDE_TYPES, StructuredOutputsParams

#: Names accepted by :func:`make_backend`.
BACKENDS = ("auto", "xgrammar", "llguidance")


def make_backend(
    name: str, tokenizer: Any, padded_vocab_size: int, stop_token_ids: list, **kwargs: Any
) -> GuidedBackend:
    """Build a guided-decoding backend for ``tokenizer``.

    Parameters
    ----------
    name : str
        ``"auto"`` (xgrammar or llguidance per request, :mod:`tpguide.guided.auto_backend`),
        ``"xgrammar"`` or ``"llguidance"``.
    tokenizer : transformers.PreTrainedTokenizerFast
    padded_vocab_size : int
        Bitmask width in tokens.
    stop_token_ids : list of int
        From :func:`collect_stop_token_ids`.
    **kwargs
        Backend options (``json_whitespace``, ``cache_size``, ...).

    Raises
    ------
    ValueError
        Unknown ``name`` (the message lists :data:`BACKENDS`).
    """
    if name == "auto":
        from tpguide.guided.auto_backend import AUTO_ORDER, AutoBackend

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


__all__ = [
    "BACKENDS",
    "GUIDE_KEYS",
    "GUIDE_TYPES",
    "GrammarMatcher",
    "GuidedBackend",
    "GuidedDecoder",
    "StructuredOutputsParams",
    "allocate_token_bitmask",
    "collect_stop_token_ids",
    "find_dead_end_rows",
    "make_backend",
    "split_bitmask",
    "token_ids_to_bitmask_row",
    "unpack_bitmask",
]
