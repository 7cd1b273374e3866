"""Format markers that are control tokens of the tokenizer: forced and read back as token ids.

Mistral's tokenizers make ``[TOOL_CALLS]`` a control token: it is in
``added_tokens_decoder`` with ``special: true`` but not among
``additional_special_tokens``, and decoded text (``skip_special_tokens``)
omits it.  Such a marker is never text to tpguide:

* the guide forces it as its token id (xgrammar's ``token`` format and
  ``token_triggered_tags``; ``<[id]>`` in llguidance's Lark), never as the
  text pieces ``[``, ``TO``, ``OL``, ... (:mod:`~tpguide.serving.tool_formats.guide`);
* the parser reads calls from the output's token ids: :func:`marker_text`
  decodes them with each marker id written as one sentinel character, a
  Unicode noncharacter (U+FDD0 + k, "reserved for internal use"), which
  the model's text cannot hold, so a marker the model spells as text is
  text and a decode that omits special tokens loses nothing.

docs/tool-calls.md describes the rule; vLLM's mistral parser and xgrammar's
structural tags trigger on the token id as well.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple, Union

#: The sentinel of the k-th control marker of a format is ``chr(SENTINEL_BASE + k)``.
SENTINEL_BASE = 0xFDD0

Controls = Tuple[Tuple[str, int], ...]


def special_tokens(tokenizer: Any) -> Dict[str, int]:
    """Text -> id of every special token: ``all_special_tokens`` and ``added_tokens_decoder`` entries flagged special."""
    out: Dict[str, int] = {}
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            out[str(getattr(added, "content", added))] = int(token_id)
    for text in getattr(tokenizer, "all_special_tokens", ()) or ():
        token_id = tokenizer.convert_tokens_to_ids(text)
        if isinstance(token_id, int) and token_id >= 0:
            out.setdefault(text, token_id)
    return out


def find_controls(literals: Sequence[str], tokenizer: Any) -> Controls:
    """The (text, id) of each special token of ``tokenizer`` that occurs in one of ``literals``, longest first."""
    found = {t: i for t, i in special_tokens(tokenizer).items() if t and any(t in lit for lit in literals)}
    return tuple(sorted(found.items(), key=lambda item: (-len(item[0]), item[0])))


def split_controls(literal: str, controls: Controls) -> List[Union[str, int]]:
    """``literal`` as text pieces and control token ids, in order (``"[TOOL_CALLS] ["`` -> ``[id, " ["]``)."""
    pieces: List[Union[str, int]] = []
    rest = literal
    while rest:
        hits = [(rest.find(text), -len(text), text, tid) for text, tid in controls if text in rest]
        if not hits:
            pieces.append(rest)
            break
        at, _, text, tid = min(hits)
        if at:
            pieces.append(rest[:at])
        pieces.append(tid)
        rest = rest[at + len(text):]
    return pieces


def with_sentinels(literal: str, controls: Controls) -> str:
    """``literal`` with each control marker replaced by its sentinel character (the text the scanner reads)."""
    return "".join(p if isinstance(p, str) else _sentinel(controls, p) for p in split_controls(literal, controls))


def _sentinel(controls: Controls, token_id: int) -> str:
    k = next(k for k, (_, tid) in enumerate(controls) if tid == token_id)
    return chr(SENTINEL_BASE + k)


def marker_text(tokenizer: Any, token_ids: Sequence[int], controls: Controls, final: bool = True) -> str:
    """The text the scanner reads: ``token_ids`` decoded (special tokens skipped), control markers as sentinels.

    Parameters
    ----------
    tokenizer : transformers tokenizer
    token_ids : sequence of int
        The answer's tokens (a thinking request's after ``</think>``).
    controls : tuple of (str, int)
        The format's control markers (``JsonCallFormat.controls``).
    final : bool
        False while streaming: a character cut by the last token (U+FFFD at the end) is held back.
    """
    return MarkerText(tokenizer, controls).update(token_ids, final)


class MarkerText:
    """:func:`marker_text` of a growing output, decoding only the tokens after its last control marker.

    The text up to and including the last marker never changes (a marker
    ends a decode run), so a stream's step costs the decode of the run
    after it, not of the whole output.
    """

    def __init__(self, tokenizer: Any, controls: Controls) -> None:
        self.tokenizer = tokenizer
        self._sentinels = {tid: chr(SENTINEL_BASE + k) for k, (_, tid) in enumerate(controls)}
        self._num_ids, self._text = 0, ""  # the ids through the last marker seen, and their text

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if ids else ""

    def update(self, token_ids: Sequence[int], final: bool = True) -> str:
        """The text of ``token_ids`` (the whole output so far; it only grows between calls)."""
        ids = [int(t) for t in token_ids]
        start = self._num_ids
        for k in range(start, len(ids)):
            if ids[k] in self._sentinels:
                self._text += self._decode(ids[start:k]) + self._sentinels[ids[k]]
                start = self._num_ids = k + 1
        text = self._text + self._decode(ids[start:])
        return text if final else text.rstrip("\ufffd")
