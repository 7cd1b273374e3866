"""What a scan of output text finds: the calls whose header is complete, the content around them, where a call opens.

Both call syntaxes (:mod:`tpguide.serving.tool_formats.json_calls`,
:mod:`tpguide.serving.tool_formats.xml_calls`) return a :class:`Scan`; the
non-streamed parser and the stream (``serving/tool_stream.py``) read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple


@dataclass
class ScannedCall:
    """A call whose header is complete: ``arguments`` is its JSON text so far (all of it once ``complete``)."""

    name: str
    arguments: str
    complete: bool
    start: int  # where the call (or its list) starts in the text


@dataclass
class Scan:
    """What a prefix of an output holds.

    ``content`` is the text outside calls that can no longer start one (all
    of it when ``final``); ``open_at`` is where an unfinished call or list
    starts (None when there is none); ``syntax_tail`` counts the characters
    at the end of a ``final`` scan's ``content`` that could begin a call
    (``<tool_call`` cut by ``max_tokens``).
    """

    content: str
    calls: List[ScannedCall] = field(default_factory=list)
    open_at: Optional[int] = None
    syntax_tail: int = 0

    def answer_content(self, cut: bool = False) -> str:
        """The content of a finished output: ``cut`` (it hit ``max_tokens``) drops a call opening cut short."""
        if cut and self.syntax_tail:
            return self.content[:len(self.content) - self.syntax_tail]
        return self.content

    def finished(self, cut: bool = False) -> Tuple[Optional[str], List[Tuple[str, str]]]:
        """(content, complete calls) of a finished output (scanned with ``final=True``).

        No call syntax is content: an unfinished call is dropped, and so is
        the start of a call cut by ``max_tokens`` (``cut``); content is None
        when only whitespace remains, and stripped beside calls or dropped syntax.
        """
        calls = [(c.name, c.arguments) for c in self.calls if c.complete]
        content = self.answer_content(cut)
        if not content.strip():
            return None, calls
        dropped = self.open_at is not None or (cut and self.syntax_tail)
        return (content.strip() if calls or dropped else content), calls


def prefix_hold(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``.

    A streaming scan holds that many characters back: they may still become ``tag``.
    """
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
