"""JSON layouts for grammar drafts: a guide compiled per ``json.dumps`` style over bytes, matched on token bytes.

docs/architecture.md §5 "JSON layouts".  A layout's grammar allows one
spelling of each value's whitespace, so it forces the text a model writing
that layout writes; the grammar drafter (:mod:`tpguide.speculative.grammar_draft`)
only asks it two things: which text is forced now
(``find_jump_forward_string``) and whether the next output token keeps the
layout.  Neither needs a token mask, so a layout is compiled by xgrammar over
a 256-token byte vocabulary, not the model's: xgrammar's compile time is
dominated by its per-state token-mask cache over the vocabulary, and a byte
vocabulary makes it about 20x cheaper (32 JSONSchemaBench schemas x 4
layouts, one thread: 36 s over SmolLM2's 49,152 tokens, 1.8 s over bytes).
The matcher then advances by the output token's bytes
(``accept_string``), which walks the same grammar states as accepting the
token itself, so the drafts are the same.
"""

from __future__ import annotations

from typing import Optional, Sequence

import xgrammar as xgr

from tpguide.guided.lru import LRUCache
from tpguide.guided.params import JSON_GUIDE_TYPES, StructuredOutputsParams
from tpguide.guided.xgrammar_backend import make_grammar_compiler, xgrammar_message

#: JSON layouts (``json.dumps`` styles) the grammar drafter guesses a model writes:
#: ``compile_json_schema`` options with no other whitespace, so the layout's grammar
#: forces every separator and indentation.  The race's order: the first layout still
#: alive supplies the draft.
JSON_LAYOUTS = {
    "indent2": {"indent": 2, "separators": (",", ": ")},
    "spaced": {"separators": (", ", ": ")},
    "indent4": {"indent": 4, "separators": (",", ": ")},
    "compact": {"separators": (",", ":")},
}

_BYTE_VOCAB_STOP = 256  # the byte vocabulary's one stop id (an empty token)


class LayoutMatcher:
    """One layout's matcher, advanced by the model's tokens through their bytes.

    Parameters
    ----------
    compiled : xgrammar.CompiledGrammar
        A layout compiled by :class:`LayoutCompiler` (byte vocabulary).
    token_bytes : sequence of bytes
        The model's token id -> its text's bytes; ``b""`` for special and
        padded ids (such a token leaves every layout, as the model
        vocabulary's matcher rejects it).
    """

    def __init__(self, compiled: xgr.CompiledGrammar, token_bytes: Sequence[bytes]) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._token_bytes = token_bytes

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``'s bytes; False (state unchanged) where the layout does not allow them."""
        data = self._token_bytes[token_id] if 0 <= token_id < len(self._token_bytes) else b""
        return bool(data) and self._matcher.accept_string(data)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def find_jump_forward_string(self) -> str:
        """The text the layout forces next (``""`` where nothing is forced)."""
        return "" if self._matcher.is_terminated() else self._matcher.find_jump_forward_string()


class LayoutCompiler:
    """Compiles and caches JSON guides' layouts (LRU), over a byte vocabulary.

    Parameters
    ----------
    token_bytes : sequence of bytes
        The model's token id -> bytes table (``xgrammar.TokenizerInfo.decoded_vocab``
        of the guided backend's tokenizer info), handed to each matcher.
    json_whitespace : str
        The backend's default JSON whitespace (a cache-key part, as for guides).
    capacity : int
        Compiled layouts kept.
    max_threads : int
        xgrammar compiler threads.
    """

    def __init__(self, token_bytes: Sequence[bytes], json_whitespace: str, capacity: int = 512,
                 max_threads: int = 1) -> None:
        vocab = [bytes([b]) for b in range(256)] + [b""]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[_BYTE_VOCAB_STOP])
        self._compiler = make_grammar_compiler(info, max_threads)
        self.token_bytes = token_bytes
        self.json_whitespace = json_whitespace
        self._cache = LRUCache(capacity)

    def __len__(self) -> int:
        return len(self._cache)

    def _key(self, params: StructuredOutputsParams, layout: str) -> tuple:
        return (layout,) + params.cache_key(self.json_whitespace)

    def compile(self, params: StructuredOutputsParams, layout: str) -> xgr.CompiledGrammar:
        """``params``'s JSON guide compiled for ``layout``, from the cache when seen (the compile thread).

        Raises
        ------
        ValueError
            ``params`` is not a JSON guide, ``layout`` is not in
            :data:`JSON_LAYOUTS`, or xgrammar cannot compile it.
        """
        if params.guide_type not in JSON_GUIDE_TYPES or layout not in JSON_LAYOUTS:
            raise ValueError(f"no {layout!r} JSON layout for a {params.guide_type} guide "
                             f"(layouts: {list(JSON_LAYOUTS)}, JSON guide types: {list(JSON_GUIDE_TYPES)})")
        compiled = self.cached(params, layout)
        if compiled is not None:
            return compiled
        try:
            compiled = self._compiler.compile_json_schema(params.guide_text, any_whitespace=False,
                                                          **JSON_LAYOUTS[layout])
        except Exception as exc:  # xgrammar raises RuntimeError
            raise ValueError(f"xgrammar cannot compile the {layout} layout: {xgrammar_message(exc)}") from exc
        self._cache.put(self._key(params, layout), compiled)
        return compiled

    def cached(self, params: StructuredOutputsParams, layout: str) -> Optional[xgr.CompiledGrammar]:
        """:meth:`compile`'s result if cached (never compiles: a step calls this), else None."""
        return self._cache.get(self._key(params, layout))

    def matcher(self, compiled: xgr.CompiledGrammar) -> LayoutMatcher:
        return LayoutMatcher(compiled, self.token_bytes)
