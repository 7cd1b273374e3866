"""Grammar-guided decoding on the driver (docs/architecture.md §5).

``params`` parses a request's guide, ``backends`` builds the xgrammar,
llguidance or ``auto`` backend for the tokenizer (:func:`make_backend`),
``admission`` admits each guide (fail-closed checks, then the compile, off
the step loop),
``decoder`` holds ``GuidedDecoder`` (one record per slot, fills the
bitmask), ``bitmask`` the bitmask helpers, the dead-end check and the per-rank split.  The backends are
imported lazily, so each is only needed when chosen.  Nothing here runs a
function on import; the names below are re-exported.
"""

from tpguide.guided.backends import BACKENDS, make_backend
from tpguide.guided.bitmask import (
    allocate_token_bitmask,
    find_dead_end_rows,
    split_bitmask,
    token_ids_to_bitmask_row,
    unpack_bitmask,
)
from tpguide.guided.decoder import GuidedDecoder
from tpguide.guided.matcher import GrammarMatcher, GuidedBackend
from tpguide.guided.params import GUIDE_KEYS, GUIDE_TYPES, StructuredOutputsParams

__all__ = [
    "BACKENDS",
    "GUIDE_KEYS",
    "GUIDE_TYPES",
    "GrammarMatcher",
    "GuidedBackend",
    "GuidedDecoder",
    "StructuredOutputsParams",
    "allocate_token_bitmask",
    "find_dead_end_rows",
    "make_backend",
    "split_bitmask",
    "token_ids_to_bitmask_row",
    "unpack_bitmask",
]
