"""Responses API answers: output items and the ``response`` object, from the chat path's answer.

A Responses request runs as a chat request (:mod:`tpguide.serving.responses_protocol`);
its chat message becomes output items, in this order:

* ``reasoning`` (a reasoning model's think block, as one ``reasoning_text`` part),
* ``message`` with one ``output_text`` part (left out when the output is only calls),
* one ``function_call`` per tool call (``call_id`` is the chat call's id).

``finish_reason`` ``"length"`` makes the response ``incomplete`` with
``incomplete_details.reason = "max_output_tokens"``; otherwise it is
``completed``.  Usage is OpenAI's ``input_tokens`` / ``output_tokens`` with
``output_tokens_details.reasoning_tokens`` (the output tokens up to and
including the ``</think>`` token).
"""

from __future__ import annotations

import uuid
from typing import Any, Dict, List, Optional, Sequence

from tpguide.serving.responses import usage

#: Request fields echoed in the ``response`` object, with OpenAI's defaults.
ECHOED_DEFAULTS = {"instructions": None, "max_output_tokens": None, "parallel_tool_calls": True,
                   "previous_response_id": None, "reasoning": None, "temperature": 1.0, "top_p": 1.0,
                   "tool_choice": "auto", "tools": [], "text": {"format": {"type": "text"}}, "metadata": None,
                   "user": None, "truncation": "disabled", "store": True, "top_logprobs": 0}


def new_item_id(prefix: str) -> str:
    """``msg_...``, ``rs_...``, ``fc_...``: an output item id."""
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, status: str = "completed", item_id: Optional[str] = None) -> Dict[str, Any]:
    return {"id": item_id or new_item_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def output_text_part(text: str) -> Dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: Optional[str], status: str = "completed", item_id: Optional[str] = None) -> Dict[str, Any]:
    content = [output_text_part(text)] if text is not None else []
    return {"id": item_id or new_item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": content}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed",
                       item_id: Optional[str] = None) -> Dict[str, Any]:
    return {"id": item_id or new_item_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(message: Dict[str, Any], finish_reason: str) -> List[Dict[str, Any]]:
    """The output items of one chat ``message`` (see the module docstring); the last one carries the status."""
    items: List[Dict[str, Any]] = []
    if message.get("reasoning") is not None:
        items.append(reasoning_item(message["reasoning"]))
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if not calls or content:
        items.append(message_item(content or ""))
    items.extend(function_call_item(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls)
    items[-1]["status"] = status_of(finish_reason)
    return items


def reasoning_tokens(outputs: Sequence[Any], end_token_id: Optional[int]) -> int:
    """Output tokens of the think blocks: up to and including ``</think>`` (all of them if it never came)."""
    total = 0
    for out in outputs:
        if getattr(out, "reasoning", None) is None:
            continue
        ids = list(out.token_ids)
        total += ids.index(end_token_id) + 1 if end_token_id in ids else len(ids)
    return total


def response_usage(outputs: Sequence[Any], end_token_id: Optional[int]) -> Dict[str, Any]:
    """OpenAI's Responses ``usage`` of the final outputs (one per request)."""
    counts = usage(outputs, 1)  # one choice per request: the chat counts
    return {"input_tokens": counts["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": counts["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens(outputs, end_token_id)},
            "total_tokens": counts["total_tokens"]}


def response_object(response_id: str, body: Dict[str, Any], created_at: int, status: str,
                    output: List[Dict[str, Any]], usage: Optional[Dict[str, Any]] = None,
                    error: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The ``response`` object (``object: "response"``) echoing the request's settings from ``body``."""
    echoed = {k: (body.get(k) if body.get(k) is not None else v) for k, v in ECHOED_DEFAULTS.items()}
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": response_id, "object": "response", "created_at": created_at, "status": status,
            "error": error, "incomplete_details": incomplete, "model": body.get("model"), "output": output,
            "usage": usage, **echoed}


def status_of(finish_reason: Optional[str]) -> str:
    """``completed``, or ``incomplete`` for an output cut by ``max_output_tokens``."""
    return "incomplete" if finish_reason == "length" else "completed"
