"""The server's side of reasoning models: the request fields, ``message.reasoning``, and reasoning stream deltas.

docs/reasoning.md.  The engine splits a thinking request's output
(:meth:`tpguide.guided.reasoning.ReasoningParser.split`): ``out.reasoning``
is the think block's text, ``out.text`` the answer after ``</think>``, and
tool calls are parsed from the answer only.  Here:

* ``thinking_token_budget`` and ``chat_template_kwargs`` (Qwen3's
  ``enable_thinking``) pass into the request line;
* ``include_reasoning`` (default true) keeps or drops the reasoning;
* a chat message carries ``reasoning`` and its older alias ``reasoning_content``;
* a stream sends ``reasoning`` deltas first, then ``content`` deltas.
"""

from __future__ import annotations

from typing import Any, Dict

from tpguide.serving.errors import bad_request

#: Chat fields of reasoning models (vLLM's names).
CHAT_REASONING_FIELDS = frozenset({"thinking_token_budget", "chat_template_kwargs", "include_reasoning"})
#: Completion fields of reasoning models.
COMPLETION_REASONING_FIELDS = frozenset({"thinking_token_budget"})

_REPLACEMENT = "\ufffd"


def reasoning_line_fields(body: Dict[str, Any]) -> Dict[str, Any]:
    """The request-line fields of ``body``'s reasoning options (validated by the request line)."""
    return {key: body[key] for key in ("thinking_token_budget", "chat_template_kwargs") if body.get(key) is not None}


def include_reasoning(body: Dict[str, Any]) -> bool:
    """``body["include_reasoning"]``, default True.

    Raises
    ------
    APIError
        400 when it is not a boolean.
    """
    value = body.get("include_reasoning", True)
    if not isinstance(value, bool):
        raise bad_request(f"include_reasoning must be true or false, got {value!r}", "include_reasoning")
    return value


def with_reasoning(message: Dict[str, Any], reasoning, include: bool) -> Dict[str, Any]:
    """``message`` with ``reasoning`` and ``reasoning_content`` (None: the request did not think)."""
    if reasoning is None or not include:
        return message
    return {**message, "reasoning": reasoning, "reasoning_content": reasoning}


class ReasoningStream:
    """What a streamed choice has sent of its reasoning, and the next delta."""

    def __init__(self) -> None:
        self.sent = ""

    def delta(self, reasoning: str, final: bool) -> str:
        """The new part of ``reasoning`` (a character cut mid-UTF-8, U+FFFD, waits for its next token)."""
        text = reasoning if final else reasoning.rstrip(_REPLACEMENT)
        if not text.startswith(self.sent) or len(text) == len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta
