"""Grammar drafts: where the grammar forces text, the draft is that text's tokens (driver only).

docs/architecture.md §5.  Speculative method ``grammar`` (the default for
guided requests).  A JSON schema forces much of its output: property names,
closing brackets, a tool call's ``{"name": "get_weather", "arguments": ``.
Decoding it token by token costs one forward pass per forced token; drafting
it costs one verify pass for up to ``K`` of them::

    forced   text = the first live layout's forced text, else
                    matcher.find_jump_forward_string()     (xgrammar: its own call,
                                                            llguidance: the forced bytes)
    draft    tokenizer.encode(text, add_special_tokens=False)[:K]
             the last token dropped when it is a strict prefix of a longer
             ordinary token (the model usually merges it with the free text
             that follows: '"' before '":'), as xgrammar's
             find_jump_forward_tokens does
    check    each draft accepted by the matcher, stop at the first it rejects
    walk     no forced text, or all of it drafted with room left: go on while
             the grammar allows exactly one token (a forced stop token, a
             character the string call leaves out)

all through one cursor that rolls the matcher back at the end
(:mod:`tpguide.guided.draft_cursor`).

**Layouts.**  With bounded (or any) JSON whitespace the grammar forces
little: after ``{`` a newline, a space and ``"`` are all allowed, so nothing
is forced until the property name.  But a model keeps one layout: the
embedded SmolLM2 writes ``json.dumps(indent=2)``.  So each JSON guide is also
compiled for the common ``json.dumps`` layouts
(:data:`~tpguide.guided.json_layouts.JSON_LAYOUTS`: indent 2, ``", "`` /
``": "`` on one line, indent 4, compact), whose grammars force every
separator and indentation.  One matcher per layout follows the request's
output tokens and drops out at the first token its layout does not allow; the
first layout still in the race supplies the text to draft.  A wrong guess
costs verify rows only: the request's own matcher checks every draft, and
the target model verifies them.  The layouts are compiled by xgrammar over a
byte vocabulary (:mod:`tpguide.guided.json_layouts`: no token-mask cache, about
20x cheaper than a guide) in the compile thread right after the guide's admission
(:meth:`GrammarDrafter.prepare`), whichever backend runs the guide; a step
only looks them up (a layout evicted or not compiled is not in the race).

The target model verifies the drafts with the exact rule
(:mod:`tpguide.speculative.verify`), so the output is that of
token-by-token decoding.  Unlike SGLang's jump-forward decoding,
which appends the retokenized text outright and so can change the tokens,
a tokenization the model would not choose only costs rows: the target
rejects it and emits its own token as the bonus.
"""

from __future__ import annotations

import functools
import threading
from typing import List, Optional, Tuple

from tpguide.guided.bitmask import allocate_token_bitmask, single_allowed_token
from tpguide.guided.json_layouts import JSON_LAYOUTS, LayoutCompiler, LayoutMatcher
from tpguide.guided.matcher import GuidedBackend
from tpguide.guided.params import JSON_GUIDE_TYPES, StructuredOutputsParams
from tpguide.guided.slot_record import SlotRecord
from tpguide.guided.xgrammar_backend import XGrammarBackend, make_tokenizer_info


def strict_prefix_token_ids(tokenizer) -> frozenset:
    """Ids of ordinary tokens whose text is a strict prefix of another ordinary token's text.

    Parameters
    ----------
    tokenizer : transformers tokenizer
        Special tokens (``all_special_ids``) do not count, on either side.

    Returns
    -------
    frozenset of int
        Compared on the tokenizer's own token strings (byte-level or
        metaspace form), in which a prefix of the text is a prefix of the string.
    """
    special = set(getattr(tokenizer, "all_special_ids", []))
    pieces = {token: token_id for token, token_id in tokenizer.get_vocab().items() if token_id not in special}
    prefixes = {token[:i] for token in pieces for i in range(1, len(token))}
    return frozenset(token_id for token, token_id in pieces.items() if token in prefixes)


def drafts_layouts(params: Optional[StructuredOutputsParams], default_whitespace: str) -> bool:
    """True for a JSON guide whose whitespace is not compact (compact: the guide itself forces every separator)."""
    return (params is not None and params.guide_type in JSON_GUIDE_TYPES
            and params.json_whitespace_or(default_whitespace) != "compact")


class GrammarDrafter:
    """Drafts the forced text of a guided request's grammar (see the module docstring).

    Parameters
    ----------
    tokenizer : transformers tokenizer
        The model's; its ``encode`` gives the canonical tokenization.
    padded_vocab_size : int
        Bitmask width in tokens (the walk's scratch row).
    cache_size : int
        Forced texts whose tokens are kept (a grammar forces the same strings again and again).
    """

    def __init__(self, tokenizer, padded_vocab_size: int, cache_size: int = 4096) -> None:
        self.tokenizer = tokenizer
        self.padded_vocab_size = padded_vocab_size
        self._scratch = allocate_token_bitmask(1, padded_vocab_size)
        self._tokens_of = functools.lru_cache(maxsize=cache_size)(self._encode)
        self._strict_prefix_ids = None  # built on first use (a pass over the vocabulary)
        self._layout_compiler: Optional[LayoutCompiler] = None
        self._lock = threading.Lock()

    def layout_compiler(self, backend: GuidedBackend) -> Optional[LayoutCompiler]:
        """The drafter's layout compiler (built once), over ``backend``'s xgrammar token table.

        The token bytes come from ``backend``'s xgrammar tokenizer info
        (``backend`` itself or ``auto``'s xgrammar); for ``--guided-backend
        llguidance`` one is built here.  None if xgrammar cannot read the
        tokenizer (then forced text still drafts, without layouts).
        """
        with self._lock:
            if self._layout_compiler is None:
                found = backend if isinstance(backend, XGrammarBackend) else \
                    getattr(backend, "backends", {}).get("xgrammar")  # AutoBackend
                try:
                    info = found.tokenizer_info if isinstance(found, XGrammarBackend) else \
                        make_tokenizer_info(self.tokenizer, backend.padded_vocab_size, backend.stop_token_ids)
                    self._layout_compiler = LayoutCompiler(info.decoded_vocab, backend.json_whitespace,
                                                           capacity=len(JSON_LAYOUTS) * backend.cache_size)
                except Exception:  # noqa: BLE001 - no layouts then; forced text still drafts
                    return None
            return self._layout_compiler

    def warm_up(self, backend: GuidedBackend) -> None:
        """Start-up work, off the first request (the engine's grammar-tables thread): the layout compiler
        and the strict-prefix token ids (a pass over the vocabulary)."""
        self.layout_compiler(backend)
        self._strict_prefixes()

    def _strict_prefixes(self) -> frozenset:
        """:func:`strict_prefix_token_ids` of the tokenizer, built once (a pass over the vocabulary)."""
        if self._strict_prefix_ids is None:
            self._strict_prefix_ids = strict_prefix_token_ids(self.tokenizer)
        return self._strict_prefix_ids

    def prepare(self, backend: GuidedBackend, params: StructuredOutputsParams) -> None:
        """Compile ``params``'s layouts into the layout cache (the compile thread, after admission); never raises.

        A layout that does not compile is left out of the race
        (:meth:`propose` uses cached layouts only, never compiling in a step).
        """
        if not drafts_layouts(params, backend.json_whitespace):
            return
        compiler = self.layout_compiler(backend)
        for layout in JSON_LAYOUTS if compiler is not None else ():
            try:
                compiler.compile(params, layout)
            except ValueError:
                continue

    def _layout_matchers(self, backend: GuidedBackend, record: SlotRecord, req) -> List[LayoutMatcher]:
        """``req``'s layout matchers (its slot ``record``), advanced by its output tokens; those a token ruled out dropped."""
        if record.layouts is None:
            record.layouts = []
            params = req.structured_output
            compiler = self.layout_compiler(backend) if drafts_layouts(params, backend.json_whitespace) else None
            for layout in JSON_LAYOUTS if compiler is not None else ():
                compiled = compiler.cached(params, layout)
                if compiled is not None:
                    record.layouts.append(compiler.matcher(compiled))
        start = record.answer_start  # the answer's tokens only (docs/reasoning.md)
        tokens = req.output_token_ids[start:] if start is not None else []
        for token in tokens[record.num_layout_tokens:]:
            record.layouts = [m for m in record.layouts if not m.is_terminated() and m.accept_token(token)]
        record.num_layout_tokens = len(tokens)
        return record.layouts

    def _encode(self, text: str) -> Tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def draft_tokens(self, text: str, k: int) -> List[int]:
        """The canonical tokens of forced ``text``, at most ``k``, the last dropped if a longer token extends it."""
        tokens = list(self._tokens_of(text)) if text else []
        if len(tokens) > k:
            return tokens[:k]
        if tokens and tokens[-1] in self._strict_prefixes():
            tokens.pop()
        return tokens

    def propose(self, guided, slot: int, k: int, req=None) -> List[int]:
        """Up to ``k`` drafts for ``slot``'s request from its grammar state (which is unchanged afterwards).

        Parameters
        ----------
        guided : GuidedDecoder
            The driver's records; ``slot`` has one.  A thinking request drafts
            nothing until its budget forces ``</think>``; then ``</think>``
            and the grammar's forced text after it.
        slot : int
        k : int
            Most drafts (``>= 0``).
        req : DraftInput, optional
            The request in ``slot`` (its ``structured_output`` and
            ``output_token_ids``; :class:`~tpguide.speculative.propose.DraftInput`): with it a
            JSON guide's layouts are drafted (module docstring), their
            matchers kept in the slot's record; without it only forced text.

        Returns
        -------
        list of int
            Every draft accepted by the matcher in order; ``[]`` where nothing is forced.

        Raises
        ------
        ValueError
            The matcher cannot roll back (an engine bug).
        """
        drafts: List[int] = []
        if k <= 0:
            return drafts
        record = guided.record(slot)
        if record.is_thinking:  # nothing is forced, until the budget forces </think> (docs/reasoning.md)
            if not record.thinking.walk().at_budget:
                return drafts
            drafts.append(record.thinking.end_token_id)
        if record.matcher is None or len(drafts) == k:
            return drafts
        layouts = self._layout_matchers(guided.backend, record, req) if req is not None else []
        with guided.drafting(slot) as cursor:
            matcher = cursor.matcher
            text = layouts[0].find_jump_forward_string() if layouts else ""
            tokens = self.draft_tokens(text or matcher.find_jump_forward_string(), k - len(drafts))
            for token in tokens:
                if not cursor.accept(token):
                    return drafts
                drafts.append(token)
                if matcher.is_terminated():
                    return drafts
            while len(drafts) < k:  # the backend-neutral walk: exactly one token allowed
                try:
                    matcher.fill_next_token_bitmask(self._scratch, 0)
                except Exception:  # noqa: BLE001 - no draft here; the verify pass's fill reports errors
                    break
                token = single_allowed_token(self._scratch[0], self.padded_vocab_size)
                if token is None or not cursor.accept(token):
                    break
                drafts.append(token)
                if matcher.is_terminated():
                    break
        return drafts
