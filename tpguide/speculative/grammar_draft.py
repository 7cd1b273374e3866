"""Grammar drafts: where the grammar forces text, the draft is that text's tokens (driver only).

docs/architecture.md §5.  Speculative method ``grammar`` (the default for
guided requests).  A JSON schema forces much of its output: property names,
closing brackets, a tool call's ``{"name": "get_weather", "arguments": ``.
Decoding it token by token costs one forward pass per forced token; drafting
it costs one verify pass for up to ``K`` of them::

    forced   text = matcher.find_jump_forward_string()     (xgrammar: its own call,
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
(:mod:`tpguide.guided.spec_decoder`).  The target model verifies the drafts
with the exact rule (:mod:`tpguide.speculative.verify`), so the output is
that of token-by-token decoding.  Unlike SGLang's jump-forward decoding,
which appends the retokenized text outright and so can change the tokens,
a tokenization the model would not choose only costs rows: the target
rejects it and emits its own token as the bonus.
"""

from __future__ import annotations

import functools
from typing import List, Tuple

from tpguide.guided.bitmask import allocate_token_bitmask, single_allowed_token


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

    def _encode(self, text: str) -> Tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def draft_tokens(self, text: str, k: int) -> List[int]:
        """The canonical tokens of forced ``text``, at most ``k``, the last dropped if a longer token extends it."""
        tokens = list(self._tokens_of(text)) if text else []
        if len(tokens) > k:
            return tokens[:k]
        if self._strict_prefix_ids is None:
            self._strict_prefix_ids = strict_prefix_token_ids(self.tokenizer)
        if tokens and tokens[-1] in self._strict_prefix_ids:
            tokens.pop()
        return tokens

    def propose(self, guided, slot: int, k: int) -> List[int]:
        """Up to ``k`` drafts for ``slot``'s request from its grammar state (which is unchanged afterwards).

        Parameters
        ----------
        guided : SpeculativeGuidedDecoder
            The driver's matchers; ``slot`` is guided.
        slot : int
        k : int
            Most drafts (``>= 0``).

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
        with guided.drafting(slot) as cursor:
            matcher = cursor.matcher
            tokens = self.draft_tokens(matcher.find_jump_forward_string(), k)
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
