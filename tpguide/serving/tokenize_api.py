"""``POST /tokenize`` and ``POST /detokenize``, as vLLM serves them (docs/serving.md "Tokenizer endpoints").

``/tokenize`` takes a ``prompt`` (encoded as ``/v1/completions`` encodes
it, ``add_special_tokens`` default true) or chat ``messages`` (with
``tools``, ``chat_template_kwargs``: rendered exactly as
``/v1/chat/completions`` renders them, tool prompt included, so ``count``
equals that request's ``usage.prompt_tokens``), and answers
``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs``
only with ``return_token_strs: true``).  ``/detokenize`` takes ``tokens``
and answers ``{"prompt"}`` (special tokens kept, as vLLM decodes them).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Dict, List

from fastapi import FastAPI, Request

from tpguide.serving.errors import APIError, bad_request, unsupported
from tpguide.serving.protocol import parse_request

_PROMPT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_CHAT_FIELDS = {"model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                "return_token_strs", "tools", "tool_choice", "chat_template_kwargs"}
_ids = itertools.count()


def _check_model(body: Dict[str, Any], served: str) -> None:
    model = body.get("model")
    if model is not None and model != served:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served!r}",
                       "not_found_error", "model", "model_not_found")


def _flag(body: Dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {value!r}", name)
    return value


def tokenize_body(body: Any, state: Any) -> Dict[str, Any]:
    """The ``/tokenize`` answer for ``body`` (see the module docstring).

    Raises
    ------
    APIError
        400 naming the field: neither or both of ``prompt`` / ``messages``,
        unknown fields, chat options tpguide's chat path does not use
        (``add_generation_prompt: false``, ``continue_final_message``,
        ``add_special_tokens: true`` with messages).
    """
    from tpguide.engine.intake import tokenize_prompt
    from tpguide.engine.request_io import request_from_dict

    if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
        raise bad_request("the body must be an object with either 'prompt' or 'messages'")
    _check_model(body, state.served_model_name)
    chat = "messages" in body
    extra = sorted(set(body) - (_CHAT_FIELDS if chat else _PROMPT_FIELDS))
    if extra:
        raise unsupported(extra[0], "not a /tokenize field tpguide knows")
    strs = _flag(body, "return_token_strs", False)
    if chat:
        for name, used in (("add_generation_prompt", True), ("continue_final_message", False),
                           ("add_special_tokens", False)):
            if _flag(body, name, used) != used:
                raise unsupported(name, f"the chat path always uses {used}")
        chat_body = {k: body[k] for k in ("messages", "tools", "tool_choice", "chat_template_kwargs") if k in body}
        line = parse_request({"model": "", **chat_body}, "chat", "tokenize", state.guided_backend,
                             state.tool_format).lines[0]
        line.pop("structured_output", None)
        try:
            ids = tokenize_prompt(state.tokenizer, request_from_dict(line, next(_ids), 1))
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from exc
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad_request(f"prompt must be a string, got {type(prompt).__name__}", "prompt")
        ids = list(state.tokenizer(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))["input_ids"])
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
            "token_strs": state.tokenizer.convert_ids_to_tokens(ids) if strs else None}


def detokenize_body(body: Any, state: Any) -> Dict[str, str]:
    """The ``/detokenize`` answer: ``{"prompt": text}``; 400 naming ``tokens`` for ids outside the vocabulary."""
    if not isinstance(body, dict) or set(body) - {"model", "tokens"}:
        raise bad_request("the body must be an object with 'tokens' (and 'model')")
    _check_model(body, state.served_model_name)
    tokens: List[Any] = body.get("tokens")
    size = len(state.tokenizer)
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("tokens must be a list of token ids (ints)", "tokens")
    bad = [t for t in tokens if not 0 <= t < size]
    if bad:
        raise bad_request(f"tokens {bad[:5]} are outside the vocabulary [0, {size})", "tokens")
    return {"prompt": state.tokenizer.decode(tokens)}


def add_tokenize_routes(app: FastAPI, state: Any, read_body: Any) -> None:
    """Register ``POST /tokenize`` and ``POST /detokenize``; ``read_body(request)`` is the app's bounded reader."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await asyncio.to_thread(tokenize_body, await read_body(request), state)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await asyncio.to_thread(detokenize_body, await read_body(request), state)
