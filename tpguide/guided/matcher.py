"""The ``GrammarMatcher`` and ``GuidedBackend`` interfaces: one guide compiled once, one stateful matcher per request.

docs/architecture.md §5.  **The interfaces.**  A backend compiles a guide
(:class:`~tpguide.guided.params.StructuredOutputsParams`) once per distinct
:meth:`GuidedBackend.cache_key` (backend, guide type and text, ``strict``,
whitespace mode) and hands out one stateful matcher per request.  Both
backends (xgrammar, llguidance) present the same matcher semantics, which the
engine relies on:

* ``accept_token`` returns False on a token the grammar forbids and leaves the
  state unchanged (llguidance would poison its matcher; the adapter checks first).
* Accepting a stop token once the grammar is complete terminates the matcher;
  afterwards every token is rejected.
* ``fill_next_token_bitmask`` of a complete grammar allows only the stop tokens;
  of a terminated matcher too (xgrammar itself raises there).
* ``rollback(n)`` undoes the last ``n`` accepted tokens, the stop token included.
* ``find_jump_forward_string`` is the text the grammar forces next (grammar
  drafts); a backend that cannot tell returns ``""``.

**What a backend is built from**: the tokenizer, the bitmask width and the
model's stop ids (:mod:`tpguide.model.tokenizer_facts`: every end token of the
model, and the ids the tokenizer can produce).
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from tpguide.guided.bitmask import token_ids_to_bitmask_row
from tpguide.guided.lru import LRUCache
from tpguide.guided.params import DEFAULT_JSON_WHITESPACE, JSON_GUIDE_TYPES, StructuredOutputsParams


class GrammarMatcher(abc.ABC):
    """Per-request grammar state.

    Attributes
    ----------
    num_accepted_tokens : int
        Tokens accepted and not rolled back (stop token included).
    """

    num_accepted_tokens: int = 0

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (state unchanged) if the grammar forbids it."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens.

        Raises
        ------
        ValueError
            ``num_tokens`` is negative or more than :attr:`num_accepted_tokens`.
        """

    @abc.abstractmethod
    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (in place).

        Parameters
        ----------
        bitmask : torch.Tensor
            int32 ``[num_rows, bitmask_size]``, CPU, contiguous rows;
            ``bitmask_size = ceil(padded_vocab_size / 32)``.
        row : int
        """

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token has been accepted (and not rolled back)."""

    def find_jump_forward_string(self) -> str:
        """The text every continuation from this state starts with (the grammar forces it); state unchanged.

        Whole UTF-8 characters only; ``""`` when nothing is forced, the
        matcher is terminated, or the backend cannot tell (this default: the
        grammar drafter then walks the tokens while exactly one is allowed,
        docs/architecture.md §5).  xgrammar: ``find_jump_forward_string``;
        llguidance: ``compute_ff_bytes``.
        """
        return ""

    def _check_rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_accepted_tokens:
            raise ValueError(
                f"cannot roll back {num_tokens} tokens: {self.num_accepted_tokens} accepted"
            )


class GuidedBackend(abc.ABC):
    """Compiles guides for one tokenizer and makes matchers.

    Subclasses set :attr:`name` and :attr:`supported_guide_types` and
    implement :meth:`_compile` and :meth:`matcher`.

    Parameters
    ----------
    padded_vocab_size : int
        Bitmask width in tokens; ids the tokenizer cannot emit are never allowed.
    stop_token_ids : list of int
        Every end token of the model (:func:`collect_stop_token_ids`).
    cache_size : int
        Compiled guides kept (least recently used evicted).
    """

    name: str = ""
    supported_guide_types: frozenset = frozenset()
    #: Default whitespace mode of JSON guides (:mod:`tpguide.guided.params`).
    json_whitespace: str = DEFAULT_JSON_WHITESPACE

    def __init__(self, padded_vocab_size: int, stop_token_ids: list, cache_size: int = 128) -> None:
        if padded_vocab_size < 1:
            raise ValueError(f"padded_vocab_size must be >= 1, got {padded_vocab_size}")
        if not stop_token_ids:
            raise ValueError("stop_token_ids must not be empty")
        bad = [t for t in stop_token_ids if not 0 <= int(t) < padded_vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside [0, {padded_vocab_size})")
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.padded_vocab_size = padded_vocab_size
        self.stop_token_ids = sorted({int(t) for t in stop_token_ids})
        #: int32 ``[bitmask_size]`` allowing only the stop tokens (rows of terminated matchers).
        self.stop_bitmask_row = token_ids_to_bitmask_row(self.stop_token_ids, padded_vocab_size)
        self.cache_size = cache_size
        self._cache = LRUCache(cache_size)

    def cache_key(self, params: StructuredOutputsParams) -> tuple:
        """The key of ``params`` in this backend's cache (docs/architecture.md §5).

        ``(backend name, guide_type, guide_text, ("strict", strict),
        ("json_whitespace", mode))``: the name of the backend asked
        (``xgrammar``, ``llguidance``, or ``auto``, whose entry records the
        backend it chose), then every request field that changes admission or
        compilation (:meth:`StructuredOutputsParams.cache_key`), the whitespace
        mode resolved against this backend's default.
        """
        return (self.name,) + params.cache_key(self.json_whitespace)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """Compiled form of ``params``, from the LRU cache (keyed by :meth:`cache_key`) when seen before.

        Raises
        ------
        ValueError
            Invalid schema/regex/grammar/tag, or a guide type this backend does
            not support (the message says which backend does).
        """
        key = self.cache_key(params)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        if params.guide_type not in self.supported_guide_types:
            raise ValueError(
                f"guide type {params.guide_type!r} is not supported by the {self.name} backend "
                f"(supported: {sorted(self.supported_guide_types)})"
            )
        if params.guide_type in JSON_GUIDE_TYPES:
            compiled = self._compile(params.guide_type, params.guide_text,
                                     json_whitespace=params.json_whitespace_or(self.json_whitespace))
        else:
            compiled = self._compile(params.guide_type, params.guide_text)
        self._cache.put(key, compiled)
        return compiled

    def is_cached(self, params: StructuredOutputsParams) -> bool:
        """True if ``params`` is compiled in the cache (a :meth:`compile` now would be a hit)."""
        return self.cache_key(params) in self._cache

    @abc.abstractmethod
    def _compile(self, guide_type: str, guide_text: str, **options: Any) -> Any:
        """Compile one guide; raise ValueError with the backend's message on bad input.

        JSON guides get ``json_whitespace=`` (one of
        :data:`~tpguide.guided.params.WHITESPACE_MODES`), other guides no option.
        """

    @abc.abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher in the grammar's initial state."""
