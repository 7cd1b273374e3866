"""Streaming answers: OpenAI's chunk objects as Server-Sent Events, ending with ``data: [DONE]``.

:class:`ChoiceStream` turns one choice's engine outputs (token deltas) into
chunk ``choices`` entries: text from the incremental detokenizer, held back
while it could start a stop string, tool-call deltas under a tool plan,
logprobs of the new tokens, and the finish reason in the last one.  A thinking
request (docs/reasoning.md) sends its reasoning deltas before its content deltas.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from tpguide.serving.detokenizer import IncrementalDetokenizer, TextStream
from tpguide.serving.protocol import ParsedRequest
from tpguide.serving.reasoning_fields import ReasoningStream
from tpguide.serving.responses import TokenText, chat_logprobs, completion_logprobs
from tpguide.serving.tool_calls import tool_call_error, tool_output_text
from tpguide.serving.tool_formats.control_tokens import MarkerText
from tpguide.serving.tool_stream import ToolCallStream

DONE = "data: [DONE]\n\n"


def sse_event(obj: Any) -> str:
    """One ``data: <json>`` event."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def chunk(parsed: ParsedRequest, request_id: str, created: int, choices: List[Dict[str, Any]],
          usage: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
    """A ``chat.completion.chunk`` or ``text_completion`` chunk."""
    obj = {"id": request_id, "object": "chat.completion.chunk" if parsed.endpoint == "chat" else "text_completion",
           "created": created, "model": parsed.model, "choices": choices}
    if parsed.include_usage:
        obj["usage"] = usage
    return obj


class ChoiceStream:
    """The chunk entries of choice ``index`` (see the module docstring)."""

    def __init__(self, parsed: ParsedRequest, index: int, tokenizer, token_text: TokenText,
                 stop: Optional[List[str]] = None) -> None:
        self.parsed, self.index, self.token_text = parsed, index, token_text
        self.detok = IncrementalDetokenizer(tokenizer)
        self.text = TextStream(stop or ())
        self.tools = ToolCallStream(parsed.tools) if parsed.tools is not None else None
        self._markers = MarkerText(tokenizer, parsed.tools.fmt.controls) if parsed.tools is not None else None
        self.reasoning = ReasoningStream()
        self.started = False
        self.num_tokens = 0
        self._text_offset = 0

    def _entry(self, delta: Dict[str, Any], logprobs=None, finish_reason=None) -> Dict[str, Any]:
        if self.parsed.endpoint == "chat":
            return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": self.index, "text": delta.get("content", ""), "logprobs": logprobs,
                "finish_reason": finish_reason}

    def _logprobs(self, entries) -> Optional[Dict[str, Any]]:
        if self.parsed.logprobs is None or not entries:
            return None
        if self.parsed.endpoint == "chat":
            return chat_logprobs(entries, self.parsed.logprobs, self.token_text)
        lp = completion_logprobs(entries, self.parsed.logprobs, self.token_text, self._text_offset)
        self._text_offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
        return lp

    def on_output(self, out) -> List[Dict[str, Any]]:
        """Chunk entries for one engine output of this choice (the last one carries ``finish_reason``)."""
        entries: List[Dict[str, Any]] = []
        if not self.started and self.parsed.endpoint == "chat":
            entries.append(self._entry({"role": "assistant", "content": ""}))
        self.started = True
        self.num_tokens = len(out.token_ids)
        finished = out.finish_reason is not None
        reasoning = getattr(out, "reasoning", None)  # None: the request did not think
        if reasoning is None:
            self.detok.add(out.new_token_ids)
            so_far = self.detok.text
        else:  # a thinking request: the engine's answer text (docs/reasoning.md), a cut character held back
            so_far = out.text.rstrip("\ufffd")
            thought = self.reasoning.delta(reasoning, finished)
            if thought and self.parsed.include_reasoning and self.parsed.endpoint == "chat":
                entries.append(self._entry({"reasoning": thought, "reasoning_content": thought}))
        delta_text = self.text.finish(out.text) if finished else self.text.update(so_far)
        logprobs = self._logprobs(out.new_logprobs or [])
        reason = out.finish_reason if finished else None
        if self.tools is None:
            if delta_text or logprobs is not None:
                entries.append(self._entry({"content": delta_text}, logprobs))
        else:
            plan = self.parsed.tools
            text = tool_output_text(plan, self.detok.tokenizer, out, finished, self._markers) \
                if plan.fmt.controls else self.text.sent
            events = self.tools.feed(text, final=finished, cut=reason == "length")
            for k, ev in enumerate(events):
                entries.append(self._entry(ev.delta(), logprobs if k == 0 else None))
            if not events and logprobs is not None:
                entries.append(self._entry({}, logprobs))
            if reason == "stop" and tool_call_error(text, plan) is not None:
                reason = "error"  # fail closed (tool_call_error): never "tool_calls" with invalid calls
            elif reason == "stop" and self.tools.num_calls:
                reason = "tool_calls"
        if finished:
            entries.append(self._entry({}, None, reason))
        return entries


class ChatEvents:
    """The SSE text of a chat / completion stream: one ``data:`` event per chunk or error, then ``[DONE]``.

    (A Responses stream writes other events from the same chunks:
    :class:`tpguide.serving.responses_stream.ResponseEvents`.)
    """

    def start(self) -> List[str]:
        return []

    def chunk(self, obj: Dict[str, Any]) -> List[str]:
        return [sse_event(obj)]

    def error(self, err: Dict[str, Any]) -> List[str]:
        return [sse_event(err)]

    def done(self, _outputs: Any) -> List[str]:
        return [DONE]
