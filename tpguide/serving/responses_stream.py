"""A streamed Responses answer: the chat path's chunks rewritten as OpenAI's Responses events.

The events, each with a ``sequence_number`` counting from 0, sent as
``event: TYPE`` / ``data: JSON`` (no ``[DONE]``; OpenAI's Responses
streams end with the terminal event)::

    response.created, response.in_progress
    per output item, in order (reasoning, message, function calls):
      response.output_item.added
      reasoning:     response.content_part.added, response.reasoning_text.delta ...,
                     response.reasoning_text.done, response.content_part.done
      message:       response.content_part.added, response.output_text.delta ...,
                     response.output_text.done, response.content_part.done
      function_call: response.function_call_arguments.delta ...,
                     response.function_call_arguments.done
      response.output_item.done
    response.completed | response.incomplete (max_output_tokens)
    | error + response.failed

The terminal event carries the whole ``response``, whose ``output`` equals
the non-streamed answer's up to item ids (:mod:`tpguide.serving.responses_output`):
its items are built from the same deltas the chat stream sends.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Optional, Sequence

from tpguide.serving.responses_output import (
    function_call_item,
    message_item,
    output_text_part,
    reasoning_item,
    response_object,
    response_usage,
    status_of,
)


def responses_sse(event: Dict[str, Any]) -> str:
    """One Responses event: ``event: TYPE`` and ``data: JSON``."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class ResponseEvents:
    """The event stream of one response (see the module docstring).

    Parameters
    ----------
    response_id : str
    body : dict
        The Responses request (its settings are echoed in the ``response`` object).
    created_at : int
        Unix seconds.
    end_token_id : int, optional
        ``</think>``: counts ``reasoning_tokens``.
    on_done : callable, optional
        Called with the final ``response`` object (the store).
    """

    def __init__(self, response_id: str, body: Dict[str, Any], created_at: int, end_token_id: Optional[int] = None,
                 on_done: Optional[Callable[[Dict[str, Any]], None]] = None) -> None:
        self.response_id, self.body, self.created_at = response_id, body, created_at
        self.end_token_id, self.on_done = end_token_id, on_done
        self.sequence_number = 0
        self.output: List[Dict[str, Any]] = []  # items done
        self.open: Optional[Dict[str, Any]] = None  # the item being streamed
        self.finish_reason: Optional[str] = None
        self.failed = False

    def _event(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return responses_sse(event)

    def _response(self, status: str, usage=None, error=None) -> Dict[str, Any]:
        return response_object(self.response_id, self.body, self.created_at, status, list(self.output), usage,
                                error)

    def start(self) -> List[str]:
        """``response.created`` and ``response.in_progress``."""
        return [self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress"))]

    def _where(self) -> Dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def _open(self, item: Dict[str, Any]) -> List[str]:
        events = self._close("completed")
        self.open = item
        added = dict(item, status="in_progress")
        if item["type"] in ("message", "reasoning"):
            added["content"] = []
        events.append(self._event("response.output_item.added", output_index=len(self.output), item=added))
        if item["type"] == "message":
            events.append(self._event("response.content_part.added", content_index=0, part=output_text_part(""),
                                      **self._where()))
        elif item["type"] == "reasoning":
            events.append(self._event("response.content_part.added", content_index=0,
                                      part={"type": "reasoning_text", "text": ""}, **self._where()))
        return events

    def _close(self, status: str) -> List[str]:
        item = self.open
        if item is None:
            return []
        where, events = self._where(), []
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            events += [self._event("response.output_text.done", content_index=0, text=part["text"], logprobs=[],
                                   **where),
                       self._event("response.content_part.done", content_index=0, part=part, **where)]
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events += [self._event("response.reasoning_text.done", content_index=0, text=part["text"], **where),
                       self._event("response.content_part.done", content_index=0, part=part, **where)]
        else:
            events.append(self._event("response.function_call_arguments.done", arguments=item["arguments"],
                                      **where))
        events.append(self._event("response.output_item.done", output_index=where["output_index"], item=item))
        self.output.append(item)
        self.open = None
        return events

    def _text(self, kind: str, text: str) -> List[str]:
        events = [] if self.open is not None and self.open["type"] == kind else \
            self._open(message_item("", "in_progress") if kind == "message" else reasoning_item("", "in_progress"))
        self.open["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(name, content_index=0, delta=text, **extra, **self._where()))
        return events

    def chunk(self, obj: Dict[str, Any]) -> List[str]:
        """Events for one chat chunk (``chat.completion.chunk``)."""
        events: List[str] = []
        for entry in obj.get("choices", []):
            delta = entry.get("delta") or {}
            if delta.get("reasoning"):
                events += self._text("reasoning", delta["reasoning"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                fn = call.get("function") or {}
                if call.get("id") is not None:
                    events += self._open(function_call_item(call["id"], fn.get("name", ""), "", "in_progress"))
                args = fn.get("arguments") or ""
                if args and self.open is not None and self.open["type"] == "function_call":
                    self.open["arguments"] += args
                    events.append(self._event("response.function_call_arguments.delta", delta=args,
                                              **self._where()))
            if entry.get("finish_reason") is not None:
                self.finish_reason = entry["finish_reason"]
        return events

    def error(self, err: Dict[str, Any]) -> List[str]:
        """``error`` and ``response.failed`` for the chat path's error JSON ``{"error": {...}}``."""
        self.failed = True
        e = err.get("error", {})
        return [self._event("error", code=e.get("code") or e.get("type"), message=e.get("message", ""),
                            param=e.get("param")),
                self._event("response.failed", response=self._response(
                    "failed", error={"code": "server_error", "message": e.get("message", "")}))]

    def done(self, outputs: Sequence[Any]) -> List[str]:
        """The closing events and the terminal one (``response.completed`` / ``incomplete`` / ``failed``)."""
        if self.failed:
            return []
        if self.finish_reason == "error":
            return self.error({"error": {"message": "generation failed: the tool calls or the answer do not "
                                                    "validate (fail closed)", "type": "server_error"}})
        status = status_of(self.finish_reason)
        events: List[str] = []
        items = self.output + ([self.open] if self.open is not None else [])
        if not any(i["type"] in ("message", "function_call") for i in items):
            events += self._open(message_item("", "in_progress"))  # the non-streamed answer's empty message
        events += self._close(status)
        final = self._response(status, response_usage(outputs, self.end_token_id))
        if self.on_done is not None:
            self.on_done(final)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return events + [self._event(kind, response=final)]
