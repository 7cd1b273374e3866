"""OpenAI chat messages -> the ``{"role", "content"}`` strings of a request line.

* ``content`` may be a string or a list of ``{"type": "text", "text": ...}``
  parts (joined); any other part type (images, audio, files) is refused.
* ``developer`` is a ``system`` message (OpenAI's newer name).
* A chat template that renders tools gets ``tool_calls`` and ``tool``
  messages as they are (docs/tool-calls.md).  Otherwise an ``assistant``
  message's ``tool_calls`` are written back in the call syntax; a ``tool``
  message becomes a user turn wrapped in ``<tool_response>`` (hermes
  style), since the chat templates of small models have no tool role; and
  the tool prompt is appended to the first system message (or becomes one;
  or opens the first user message where the template has no system role).
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from tpguide.serving.errors import bad_request, unsupported
from tpguide.serving.tool_formats.call_format import CallFormat

_ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"}


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise unsupported(f"{where}.content[{j}]", f"content part type {kind!r} (only 'text')")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}",
                      f"{where}.content")


def _checked_calls(calls: Any, where: str) -> List[tuple]:
    """``(j, call, function)`` of each assistant tool call; 400 when ``calls`` is not a list of named functions."""
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{where}.tool_calls[{j}] needs function.name", f"{where}.tool_calls[{j}]")
        out.append((j, call, fn))
    return out


def _tool_calls_text(calls: Any, where: str, fmt: CallFormat) -> str:
    out = []
    for _, _, fn in _checked_calls(calls, where):
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        out.append((fn["name"], args))
    return fmt.render_calls(out)


def _structured_calls(calls: Any, where: str) -> List[Dict[str, Any]]:
    """Assistant ``tool_calls`` for a chat template that renders them: arguments as an object (transformers' form)."""
    out = []
    for j, call, fn in _checked_calls(calls, where):
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError as exc:
            raise bad_request(f"{where}.tool_calls[{j}].function.arguments is not JSON: {exc}",
                              f"{where}.tool_calls[{j}].function.arguments") from exc
        out.append({"id": str(call.get("id") or f"call{j}"), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def render_messages(messages: Any, fmt: CallFormat, tool_prompt: Optional[str] = None,
                    template_tools: bool = False, prompt_role: str = "system") -> List[Dict[str, Any]]:
    """Plain ``{"role", "content"}`` messages for the request line.

    ``template_tools``: the chat template renders tools itself, so an
    assistant's ``tool_calls`` stay structured (arguments as objects) and a
    ``tool`` message keeps its role and ``tool_call_id`` (docs/tool-calls.md).
    ``prompt_role="user"``: the tool prompt opens the first user message
    (for a template without a system role).

    Raises
    ------
    APIError
        400: not a non-empty list, an unknown role or key, a non-text content part.
    """
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of message objects", "messages")
    out: List[Dict[str, str]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object, got {type(m).__name__}", where)
        extra = sorted(set(m) - _MESSAGE_KEYS)
        if extra:
            raise unsupported(f"{where}.{extra[0]}")
        role = m.get("role")
        if role not in _ROLES:
            raise bad_request(f"{where}.role must be one of {list(_ROLES)}, got {role!r}", f"{where}.role")
        text = _content_text(m.get("content"), where)
        if role == "developer":
            role = "system"
        if template_tools and role == "assistant" and m.get("tool_calls"):
            out.append({"role": role, "content": text, "tool_calls": _structured_calls(m["tool_calls"], where)})
            continue
        if template_tools and role == "tool":
            out.append({"role": role, "content": text, "tool_call_id": str(m.get("tool_call_id") or ""),
                        **({"name": m["name"]} if isinstance(m.get("name"), str) else {})})
            continue
        if role == "assistant" and m.get("tool_calls"):
            calls = _tool_calls_text(m["tool_calls"], where, fmt)
            text = f"{text}\n{calls}" if text else calls
        if role == "tool":
            role, text = "user", f"<tool_response>\n{text}\n</tool_response>"
        out.append({"role": role, "content": text})
    first_user = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
    if tool_prompt and prompt_role == "user" and first_user is not None:
        out[first_user] = {**out[first_user], "content": f"{tool_prompt}\n\n{out[first_user]['content']}"}
    elif tool_prompt:
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{tool_prompt}"}
        else:
            out.insert(0, {"role": "system", "content": tool_prompt})
    return out
