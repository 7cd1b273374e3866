"""An OpenAI ``/v1/responses`` body -> the equivalent ``/v1/chat/completions`` body (docs/serving.md "Responses API").

The Responses API runs on the chat path: its request is rewritten as a chat
request and parsed by :func:`tpguide.serving.protocol.parse_request`, so the
prompt, the guides, the tool formats and the fail-closed rules are the chat
endpoint's, and a request that is the same in both APIs gives the same
request line (hence the same tokens).  The mapping:

========================  ====================================================
Responses                 chat completions
========================  ====================================================
``instructions``          a first ``system`` message
``input`` (string)        one ``user`` message
message items             messages (``input_text``/``output_text`` parts joined)
``function_call`` items   an ``assistant`` message's ``tool_calls``
``function_call_output``  a ``tool`` message with its ``tool_call_id``
``reasoning`` items       dropped (chat templates drop past thinking too)
``max_output_tokens``     ``max_tokens``
``text.format``           ``response_format``
function ``tools``        ``tools`` (``{"type": "function", "function": ...}``)
``tool_choice``           ``tool_choice`` (``{"type": "function", "name"}`` form)
========================  ====================================================

Every field is mapped, accepted because it does not change the output, or
refused with a 400 naming it (as on the chat endpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from tpguide.serving.errors import bad_request, unsupported

#: Fields passed to the chat body as they are (sampling, and tpguide's / vLLM's extensions).
PASSED_FIELDS = ("model", "temperature", "top_p", "parallel_tool_calls", "stream", "seed", "top_k", "stop",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
                 "thinking_token_budget", "chat_template_kwargs", "include_reasoning", "structured_outputs")
#: Fields that do not change the output (``store`` and ``previous_response_id`` are read by the server).
ACCEPTED_FIELDS = frozenset({"metadata", "user", "service_tier", "safety_identifier", "prompt_cache_key",
                             "prompt_cache_retention", "prompt_cache_options", "store", "previous_response_id",
                             "stream_options", "priority", "request_id"})
#: Fields that would change the output; refused unless they hold their neutral value.
NEUTRAL_VALUES = {"background": (None, False), "truncation": (None, "disabled"), "max_tool_calls": (None,),
                  "top_logprobs": (None, 0), "include": (None, []), "conversation": (None,), "prompt": (None,),
                  "context_management": (None, [])}
RESPONSES_FIELDS = frozenset({"input", "instructions", "max_output_tokens", "text", "tools", "tool_choice",
                              "reasoning", *PASSED_FIELDS, *NEUTRAL_VALUES})
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class ResponsesInput:
    """A Responses request as the server keeps it.

    Attributes
    ----------
    chat_body : dict
        The equivalent chat-completions body.
    items : list of dict
        The conversation's input items so far (the previous response's
        input and output first, then this request's ``input``), for the store.
    """

    chat_body: Dict[str, Any]
    items: List[Dict[str, Any]] = field(default_factory=list)


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts, got "
                          f"{type(content).__name__}", f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise unsupported(f"{where}.content[{j}]", f"content part type {kind!r} (text parts only)")
    return "".join(texts)


def _string(item: Dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string, got {type(value).__name__}", f"{where}.{key}")
    return value


def input_items(value: Any) -> List[Dict[str, Any]]:
    """``input`` as a list of items (a string is one user message).

    Raises
    ------
    APIError
        400 when ``input`` is missing, empty or not a string / list of objects.
    """
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value or not all(isinstance(x, dict) for x in value):
        raise bad_request("'input' must be a string or a non-empty list of input items", "input")
    return list(value)


def items_to_messages(items: List[Dict[str, Any]], instructions: Optional[str]) -> List[Dict[str, Any]]:
    """Chat messages of ``instructions`` and the input ``items`` (the mapping in the module docstring).

    Raises
    ------
    APIError
        400 naming ``input[i]`` for an unknown item type or role, a missing
        field, a non-text content part.
    """
    messages: List[Dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"{where}.role must be one of {list(_ROLES)}, got {role!r}", f"{where}.role")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the turn's text and its calls: one message
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, where)
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text})
        elif kind != "reasoning":
            raise unsupported(f"{where}.type", f"input item type {kind!r} (message, function_call, "
                                               "function_call_output and reasoning only)")
    if not any(m["role"] != "system" for m in messages):
        raise bad_request("'input' holds no message", "input")
    return messages


def chat_tools(tools: Any) -> Optional[List[Dict[str, Any]]]:
    """Responses function tools -> chat tools; 400 naming ``tools[i]`` for any other tool type."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise bad_request(f"'tools' must be a list, got {type(tools).__name__}", "tools")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else type(t).__name__
        if kind != "function":
            raise unsupported(f"tools[{i}].type", f"tool type {kind!r} (function tools only)")
        extra = sorted(set(t) - {"type", "name", "description", "parameters", "strict"})
        if extra:
            raise unsupported(f"tools[{i}].{extra[0]}")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                        "strict") if t.get(k) is not None}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """``tool_choice``: the strings pass, ``{"type": "function", "name"}`` becomes chat's nested form."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'name': ...}}, "
                      f"got {choice!r}", "tool_choice")


def response_format(text: Any) -> Optional[Dict[str, Any]]:
    """``text.format`` -> chat's ``response_format`` (None for plain text); 400 naming ``text.format``."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad_request(f"'text' may hold 'format' (and 'verbosity'), got {text!r}", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise unsupported("text.verbosity", "only 'medium'")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise bad_request(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          "text.format.type")
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request("text.format needs a 'schema' object (and a 'name')", "text.format.schema")
    strict = fmt.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"text.format.strict must be true or false, got {strict!r}", "text.format.strict")
    js = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
    if strict is not None:
        js["strict"] = strict
    return {"type": "json_schema", "json_schema": js}


def _check_reasoning(reasoning: Any) -> None:
    if reasoning is None:
        return
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
        raise bad_request(f"'reasoning' may hold effort and summary, got {reasoning!r}", "reasoning")
    if reasoning.get("effort") is not None:
        raise unsupported("reasoning.effort", "use thinking_token_budget (docs/reasoning.md)")


def responses_to_chat(body: Any, history: Optional[List[Dict[str, Any]]] = None) -> ResponsesInput:
    """The chat-completions body equivalent to the Responses body ``body``.

    Parameters
    ----------
    body : dict
        The decoded ``/v1/responses`` JSON body.
    history : list of dict, optional
        The items of the response named by ``previous_response_id`` (its
        input, then its output), put before this request's ``input``.

    Raises
    ------
    APIError
        400 naming the field: unknown fields, malformed items, tools or
        ``text.format``, fields tpguide cannot honour (``reasoning.effort``,
        ``background``, ``truncation: auto``, non-function tools, ...).
    """
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    for key in body:
        if key not in RESPONSES_FIELDS and key not in ACCEPTED_FIELDS:
            raise unsupported(key, "not a Responses field tpguide knows")
    for key, neutral in NEUTRAL_VALUES.items():
        if key in body and body[key] not in neutral:
            raise unsupported(key, f"only {neutral[-1]!r}")
    _check_reasoning(body.get("reasoning"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request(f"instructions must be a string, got {type(instructions).__name__}", "instructions")
    items = [*(history or []), *input_items(body.get("input"))]
    chat: Dict[str, Any] = {key: body[key] for key in PASSED_FIELDS if body.get(key) is not None}
    chat["messages"] = items_to_messages(items, instructions)
    most = body.get("max_output_tokens")
    if most is not None:
        if isinstance(most, bool) or not isinstance(most, int) or most < 1:
            raise bad_request(f"max_output_tokens must be an int >= 1, got {most!r}", "max_output_tokens")
        chat["max_tokens"] = most
    tools = chat_tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    choice = chat_tool_choice(body.get("tool_choice"))
    if choice is not None and (tools is not None or choice not in ("auto", "none")):  # "auto" without tools: no-op
        chat["tool_choice"] = choice
    fmt = response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return ResponsesInput(chat, items)
