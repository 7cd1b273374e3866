"""Tool calls while streaming: content deltas, then per call a header and argument deltas.

Fed with the choice's text so far, :class:`ToolCallStream` returns the
events to send.  The argument text of a call is sent as it grows: while its
JSON object is incomplete, everything after the call header is arguments;
once it parses, the rest of the call (``}`` and the end tag) is skipped.
Concatenated argument deltas equal the ``function.arguments`` of the
non-streamed answer (both are the same slice of the output text).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import List, Optional

from tpguide.serving.tool_calls import ToolPlan, header_regex, new_call_id


@dataclass
class ToolEvent:
    """One thing to send: ``content`` text, or a call's start (``id``, ``name``) and/or ``arguments`` text."""

    content: Optional[str] = None
    index: Optional[int] = None
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: Optional[str] = None

    def delta(self) -> dict:
        if self.content is not None:
            return {"content": self.content}
        call: dict = {"index": self.index}
        if self.id is not None:
            call.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments or ""})
        else:
            call["function"] = {"arguments": self.arguments}
        return {"tool_calls": [call]}


class ToolCallStream:
    """Incremental parser of one choice's output under a :class:`ToolPlan`."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._header = header_regex(plan.fmt)
        self._decoder = json.JSONDecoder()
        self._pos = 0  # text[:_pos] is accounted for
        self._args_start: Optional[int] = None  # inside a call's arguments
        self._skip_tail = False  # after a call's arguments, before its end tag
        self.num_calls = 0
        if plan.mode == "named":
            self._args_start = 0

    def feed(self, text: str, final: bool = False) -> List[ToolEvent]:
        """Events for ``text`` (the whole output so far); ``final`` flushes held-back content."""
        events: List[ToolEvent] = []
        if self.plan.mode == "named":
            if self.num_calls == 0:
                self.num_calls = 1
                events.append(ToolEvent(index=0, id=new_call_id(), name=self.plan.tools[0].name, arguments=""))
            if len(text) > self._pos:
                events.append(ToolEvent(index=0, arguments=text[self._pos:]))
                self._pos = len(text)
            return events
        while True:
            before = self._pos
            self._advance(text, final, events)
            if self._pos == before:
                return events

    def _advance(self, text: str, final: bool, events: List[ToolEvent]) -> None:
        fmt = self.plan.fmt
        if self._skip_tail:
            end = text.find(fmt.end, self._pos)
            if end >= 0:
                self._pos, self._skip_tail = end + len(fmt.end), False
            return
        if self._args_start is not None:
            try:
                _, args_end = self._decoder.raw_decode(text, self._args_start)
            except json.JSONDecodeError:
                args_end = None
            upto = len(text) if args_end is None else args_end
            if upto > self._pos:
                events.append(ToolEvent(index=self.num_calls - 1, arguments=text[self._pos:upto]))
                self._pos = upto
            if args_end is not None:
                self._args_start, self._skip_tail = None, True
            return
        m = self._header.search(text, self._pos)
        begin = text.find(fmt.begin, self._pos)
        if m is not None and m.start() == begin and m.end() < len(text):  # the header's spaces are complete
            self._emit_content(text[self._pos:begin], events)
            events.append(ToolEvent(index=self.num_calls, id=new_call_id(), name=json.loads(f'"{m.group(1)}"'),
                                    arguments=""))
            self.num_calls += 1
            self._pos = self._args_start = m.end()
            return
        upto = begin if begin >= 0 else len(text) - (0 if final else _prefix_hold(text, fmt.begin))
        if final and begin >= 0:
            upto = len(text)
        if upto > self._pos:
            self._emit_content(text[self._pos:upto], events)
            self._pos = upto

    @staticmethod
    def _emit_content(text: str, events: List[ToolEvent]) -> None:
        if text:
            events.append(ToolEvent(content=text))


def _prefix_hold(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
