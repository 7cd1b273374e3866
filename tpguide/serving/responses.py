"""Answer objects: choices, logprobs, usage, in OpenAI's formats.

``outputs`` are the engine's final :class:`~tpguide.engine.RequestOutput` of
each choice; logprob entries are the engine's
``{"token_id", "logprob", "top": [[token_id, logprob], ...]}``.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

from tpguide.serving.errors import APIError
from tpguide.serving.protocol import ParsedRequest
from tpguide.serving.reasoning_fields import with_reasoning
from tpguide.serving.tool_calls import ToolPlan, parse_tool_output, tool_call_error, tool_output_text


def _byte_level_decoder() -> Dict[str, int]:
    """Inverse of byte-level BPE's byte -> printable character table (GPT-2's ``bytes_to_unicode``)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """Token id -> its text and its raw bytes (cached), for logprobs.

    A token can hold part of a UTF-8 character: its text is then U+FFFD, and
    its ``bytes`` are the token's own bytes (byte-level BPE tokenizers), as
    OpenAI reports them.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: Dict[int, str] = {}
        self._bytes: Dict[int, List[int]] = {}
        self._decoder = _byte_level_decoder()

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id])
        return text

    def bytes_of(self, token_id: int) -> List[int]:
        raw = self._bytes.get(token_id)
        if raw is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece and all(c in self._decoder for c in piece):
                raw = [self._decoder[c] for c in piece]
            else:
                raw = list(self(token_id).encode("utf-8"))
            self._bytes[token_id] = raw
        return raw


def chat_logprobs(entries: Sequence[Dict[str, Any]], top: int, token_text: TokenText) -> Dict[str, Any]:
    """``choices[i].logprobs`` of a chat answer: ``{"content": [...], "refusal": None}``."""
    def item(token_id: int, logprob: float) -> Dict[str, Any]:
        return {"token": token_text(token_id), "logprob": logprob, "bytes": token_text.bytes_of(token_id)}

    content = [{**item(e["token_id"], e["logprob"]),
                "top_logprobs": [item(i, lp) for i, lp in e["top"][:top]]} for e in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Sequence[Dict[str, Any]], top: int, token_text: TokenText,
                        text_offset: int = 0) -> Dict[str, Any]:
    """``choices[i].logprobs`` of a completion: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, offsets, pos = [], [], text_offset
    for e in entries:
        tokens.append(token_text(e["token_id"]))
        offsets.append(pos)
        pos += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{token_text(i): lp for i, lp in e["top"][:top]} for e in entries],
            "text_offset": offsets}


def error_of(out: Any) -> APIError:
    """The answer to a failed output: 400 refused before any token (bad input); 500 for a server fault or a
    generation that failed (docs/serving.md, "Faults stay with their request")."""
    if out.server_fault:
        return APIError(500, out.error or "server error", "server_error", code="server_fault")
    if not out.token_ids:
        return APIError(400, out.error or "request failed", "invalid_request_error")
    return APIError(500, f"generation failed: {out.error}", "server_error")


def raise_if_failed(outputs: Sequence[Any]) -> None:
    """An errored choice fails the whole answer (:func:`error_of`)."""
    for out in outputs:
        if out.finish_reason == "error":
            raise error_of(out)


def usage(outputs: Sequence[Any], n: int) -> Dict[str, int]:
    """Prompt tokens counted once per prompt (every ``n``-th output), completion tokens of every choice."""
    prompt = sum(o.num_prompt_tokens for o in outputs[::n])
    completion = sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def tool_calls_json(calls: Sequence[tuple], plan: ToolPlan) -> List[Dict[str, Any]]:
    return [{"id": plan.fmt.new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}
            for name, args in calls]


def chat_message(text: str, tools: Optional[ToolPlan], finish_reason: str) -> tuple:
    """(message, finish_reason) of a chat choice.

    Complete calls are tool calls whatever the finish reason (a stream has
    sent them already); ``finish_reason`` becomes ``"tool_calls"`` only for
    an output that ended by itself (``"stop"``), and then its calls must
    parse and validate (fail closed: else a 500 naming the reason).  No
    call syntax reaches ``content``: a call cut by ``max_tokens`` goes
    nowhere (``parse_tool_output``).  With ``tools``, ``text`` is
    :func:`~tpguide.serving.tool_calls.tool_output_text`.
    """
    if tools is None:
        return {"role": "assistant", "content": text}, finish_reason
    if finish_reason == "stop":
        invalid = tool_call_error(text, tools)
        if invalid is not None:
            raise APIError(500, f"generation failed: {invalid}", "server_error")
    content, calls = parse_tool_output(text, tools, cut=finish_reason == "length")
    if not calls:
        return {"role": "assistant", "content": content}, finish_reason
    reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return {"role": "assistant", "content": content, "tool_calls": tool_calls_json(calls, tools)}, reason


def build_answer(parsed: ParsedRequest, request_id: str, outputs: Sequence[Any], token_text: TokenText,
                 created: Optional[int] = None) -> Dict[str, Any]:
    """The non-streamed answer (``chat.completion`` or ``text_completion``)."""
    raise_if_failed(outputs)
    created = created or int(time.time())
    choices = []
    for k, out in enumerate(outputs):
        if parsed.endpoint == "chat":
            text = out.text if parsed.tools is None else tool_output_text(parsed.tools, getattr(token_text, "tokenizer", None), out)
            message, reason = chat_message(text, parsed.tools, out.finish_reason)  # the answer only
            message = with_reasoning(message, getattr(out, "reasoning", None), parsed.include_reasoning)
            lp = chat_logprobs(out.logprobs or [], parsed.logprobs, token_text) if parsed.logprobs is not None \
                else None
            choices.append({"index": k, "message": message, "logprobs": lp, "finish_reason": reason})
        else:
            lp = completion_logprobs(out.logprobs or [], parsed.logprobs, token_text) \
                if parsed.logprobs is not None else None
            choices.append({"index": k, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason})
        if parsed.return_token_ids:
            choices[-1]["token_ids"] = list(out.token_ids)
    return {"id": request_id, "object": "chat.completion" if parsed.endpoint == "chat" else "text_completion",
            "created": created, "model": parsed.model, "choices": choices, "usage": usage(outputs, parsed.n)}
