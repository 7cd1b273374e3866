"""Incremental detokenization for streaming: text deltas that never split a UTF-8 character.

Byte-level BPE tokens can end in the middle of a multi-byte character;
decoding such a prefix yields U+FFFD.  The detokenizer decodes a short
window of recent tokens (vLLM's prefix/read offsets, after Hugging Face's
``TextStreamer``) and holds a delta back while it ends in U+FFFD.

A stop-string holdback sits on top: while the output's tail could be the
start of a stop string, those characters are not sent yet, so a streamed
answer never shows text the final answer cuts.
"""

from __future__ import annotations

from typing import List, Sequence

from tpguide.engine.detokenize import DetokenizeState, detokenize_incrementally


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas (:func:`~tpguide.engine.detokenize.detokenize_incrementally`).

    Parameters
    ----------
    tokenizer : transformers tokenizer
    skip_special_tokens : bool
        As the offline output text (``True``).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.token_ids: List[int] = []
        self._state = DetokenizeState()

    @property
    def text(self) -> str:
        """The complete text so far."""
        return self._state.text

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly complete text (maybe ``""``)."""
        self.token_ids.extend(int(t) for t in new_token_ids)
        return detokenize_incrementally(self.tokenizer, self.token_ids, self._state, self.skip)


def stop_holdback(text: str, stop: Sequence[str]) -> int:
    """Characters at the end of ``text`` that could begin a stop string (to hold back while streaming)."""
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if s.startswith(text[-k:]):
                hold = k
                break
    return hold


class TextStream:
    """What a streamed choice has sent so far, and the next delta.

    ``update(text_so_far)`` returns the part of ``text_so_far`` that is
    safe to send; ``finish(final_text)`` returns the rest of the final text
    (the engine's own decode, cut at a stop string).  When the final text
    does not extend what was sent (cannot happen for outputs cut only at
    stop strings, which are held back), the answer's text is authoritative
    and the stream sends what follows the common prefix.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = tuple(stop)
        self.sent = ""

    def update(self, text_so_far: str) -> str:
        if self.stop:
            cut = min((i for i in (text_so_far.find(s) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                text_so_far = text_so_far[:cut]
            else:
                text_so_far = text_so_far[:len(text_so_far) - stop_holdback(text_so_far, self.stop)]
        if len(text_so_far) <= len(self.sent) or not text_so_far.startswith(self.sent):
            return ""
        delta = text_so_far[len(self.sent):]
        self.sent = text_so_far
        return delta

    def finish(self, final_text: str) -> str:
        if final_text.startswith(self.sent):
            delta = final_text[len(self.sent):]
        else:
            common = 0
            while common < min(len(final_text), len(self.sent)) and final_text[common] == self.sent[common]:
                common += 1
            delta = final_text[common:]
        self.sent = final_text
        return delta
