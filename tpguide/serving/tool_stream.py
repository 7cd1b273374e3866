"""Tool calls while streaming: content deltas, then per call a header and argument deltas.

Fed with the choice's text so far, :class:`ToolCallStream` returns the
events to send.  Each feed scans the whole text with the format's scanner
(:meth:`~tpguide.serving.tool_formats.json_calls.JsonCallFormat.scan`) and
sends what grew since the last feed: content outside calls (held back while
it could start a call), a call once its header is complete, its arguments
as they grow.  Concatenated argument deltas equal the ``function.arguments``
of the non-streamed answer (both are the same slice of the output text).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from tpguide.serving.tool_calls import ToolPlan


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
        self._sent_content = 0  # characters of the scan's content sent
        self._sent_args: List[int] = []  # per call sent so far: characters of its arguments

    @property
    def num_calls(self) -> int:
        return len(self._sent_args)

    def feed(self, text: str, final: bool = False, cut: bool = False) -> List[ToolEvent]:
        """Events for ``text`` (the whole output so far, :func:`~tpguide.serving.tool_calls.tool_output_text`).

        ``final`` flushes held-back content, except, with ``cut`` (the
        output hit ``max_tokens``), the start of a call cut short: as
        :func:`~tpguide.serving.tool_calls.parse_tool_output`, no call syntax is content.
        """
        scan = self.plan.fmt.scan(text, final, self.plan.schemas)
        content = scan.answer_content(cut) if final else scan.content
        events: List[ToolEvent] = []
        if len(content) > self._sent_content:
            events.append(ToolEvent(content=content[self._sent_content:]))
            self._sent_content = len(content)
        for i, call in enumerate(scan.calls):
            if i == len(self._sent_args):
                events.append(ToolEvent(index=i, id=self.plan.fmt.new_call_id(), name=call.name, arguments=""))
                self._sent_args.append(0)
            if len(call.arguments) > self._sent_args[i]:
                events.append(ToolEvent(index=i, arguments=call.arguments[self._sent_args[i]:]))
                self._sent_args[i] = len(call.arguments)
        return events
