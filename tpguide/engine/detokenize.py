"""Incremental detokenization: a growing output's text at a cost per step that does not grow with its length.

Decoding a request's whole output at every step costs O(n) per step and
O(n^2) per request (at 128 rows of 128 tokens, 5 ms of host time a step:
the whole step of a small model on a GPU).  As vLLM's detokenizer (after
Hugging Face's ``TextStreamer``), :func:`detokenize_incrementally` decodes
only a window: the tokens since the last complete text (``read_offset``)
plus the few before them (``prefix_offset``) that a tokenizer needs to
place the new text (SentencePiece's leading space, byte-level BPE's split
characters), and adds the difference.  A text that ends in U+FFFD (a token
that ends inside a multi-byte character) is held back until it completes.
For a byte-level tokenizer the accumulated text equals the whole decode;
the engine still decodes a finished output whole (docs/architecture.md §1,
step 10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["DetokenizeState", "detokenize_incrementally"]

_REPLACEMENT = "\ufffd"


@dataclass
class DetokenizeState:
    """Where a detokenized output stands.

    Attributes
    ----------
    num_ids : int
        Tokens of the output seen so far.
    prefix_offset, read_offset : int
        The window's start, and the first token whose text is not in ``text`` yet.
    text : str
        The complete text so far.
    """

    num_ids: int = 0
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""


def _decode_window(tokenizer, ids: Sequence[int], skip_special_tokens: bool) -> str:
    """``tokenizer.decode(ids)``; through a fast tokenizer's Rust decoder when that gives the same text.

    ``tokenizer.decode`` converts its input and may clean up spaces around
    punctuation (``clean_up_tokenization_spaces``); without that clean-up it
    returns the backend's decode, which costs a fifth of the time.
    """
    if not ids:
        return ""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def detokenize_incrementally(tokenizer, token_ids: Sequence[int], state: DetokenizeState,
                             skip_special_tokens: bool = True) -> str:
    """Advance ``state`` over ``token_ids[state.num_ids:]``; return the newly complete text (maybe ``""``).

    Parameters
    ----------
    tokenizer : transformers tokenizer
    token_ids : sequence of int
        The whole output so far (it only grows between calls).
    state : DetokenizeState
        Updated in place; ``state.text`` is the text so far.
    skip_special_tokens : bool
        As the output text (``True``).
    """
    if len(token_ids) == state.num_ids:
        return ""
    state.num_ids = len(token_ids)
    prefix = _decode_window(tokenizer, token_ids[state.prefix_offset:state.read_offset], skip_special_tokens)
    full = _decode_window(tokenizer, token_ids[state.prefix_offset:], skip_special_tokens)
    if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
        delta = full[len(prefix):]
        state.prefix_offset, state.read_offset = state.read_offset, len(token_ids)
        state.text += delta
        return delta
    return ""
