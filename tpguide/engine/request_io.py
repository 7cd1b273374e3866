"""Requests files (JSON lines in) and outputs (JSON lines out).

Request line (field names follow vLLM's structured-outputs parameters)::

    {"id": str, "messages": [{"role": ..., "content": ...}, ...] | "prompt": str,
     "structured_output": {"json": schema} | {"regex": str} | {"choice": [str]}
                          | {"grammar": str} | {"json_object": true}
                          | {"structural_tag": ...} | null,
     "max_tokens": int, "temperature": float, "top_k": int, "top_p": float,
     "seed": int, "logprobs": int, "prompt_logprobs": int | null, "ignore_eos": bool,
     "stop": [str], "presence_penalty": float, "frequency_penalty": float,
     "repetition_penalty": float, "logit_bias": {"token_id": float},
     "chat_template_kwargs": {name: value} | null}   # vLLM's name, e.g. {"enable_thinking": false}

A line that cannot be parsed or validated becomes a request that is already
finished with ``finish_reason="error"``: it still gets its output line, in
input order, and nothing else is affected.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Iterable, List

from tpguide.engine.request import Request, RequestOutput
from tpguide.engine.sampling_params import SamplingParams

REQUEST_FIELDS = frozenset(
    {"id", "messages", "prompt", "structured_output", "max_tokens", "temperature",
     "top_k", "top_p", "seed", "logprobs", "prompt_logprobs", "ignore_eos", "stop", "presence_penalty",
     "frequency_penalty", "repetition_penalty", "logit_bias", "chat_template_kwargs"}
)
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "logprobs", "prompt_logprobs",
                    "ignore_eos", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty",
                    "logit_bias")


def request_from_dict(obj: Any, index: int, default_max_tokens: int) -> Request:
    """A :class:`Request` from one decoded request line; never raises for bad input.

    A line that does not validate gives a :class:`Request` that is already
    finished with ``finish_reason="error"`` and the message of
    :func:`parse_request` (its id is the line's ``id`` when there is one,
    else ``str(index)``).
    """
    try:
        return parse_request(obj, index, default_max_tokens)
    except (ValueError, TypeError) as exc:
        return failed_request(obj, index, str(exc))


def failed_request(obj: Any, index: int, message: str) -> Request:
    """A request that is already finished with ``finish_reason="error"`` and ``message``."""
    raw_id = str(obj["id"]) if isinstance(obj, dict) and "id" in obj else str(index)
    bad = Request(request_id=raw_id, index=index, sampling_params=SamplingParams())
    bad.fail(message)
    return bad


def parse_request(obj: Any, index: int, default_max_tokens: int) -> Request:
    """Build a :class:`Request` from one decoded request line.

    Raises
    ------
    ValueError
        Unknown fields, missing or doubled prompt, malformed messages, bad
        sampling values or structured-output parameters.  The message names
        the offending values.
    """
    from tpguide.guided.params import StructuredOutputsParams

    if not isinstance(obj, dict):
        raise ValueError(f"a request line must be a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - REQUEST_FIELDS)
    if unknown:
        raise ValueError(f"unknown request field(s) {unknown}; allowed: {sorted(REQUEST_FIELDS)}")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise ValueError("a request needs exactly one of 'prompt' or 'messages'")
    if has_prompt and not isinstance(obj["prompt"], str):
        raise ValueError(f"'prompt' must be a string, got {type(obj['prompt']).__name__}")
    if has_prompt and not obj["prompt"].strip():
        raise ValueError(f"'prompt' is empty or whitespace only: {obj['prompt']!r}")
    messages = obj.get("messages")
    if has_messages:
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list of {role, content} objects")
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise ValueError(f"each message needs string 'role' and 'content', got {m!r}")
    template_kwargs = obj.get("chat_template_kwargs")
    if template_kwargs is not None:
        if not has_messages:
            raise ValueError("'chat_template_kwargs' needs 'messages' (a plain 'prompt' has no chat template)")
        if not isinstance(template_kwargs, dict) or not all(isinstance(k, str) for k in template_kwargs):
            raise ValueError(f"'chat_template_kwargs' must be an object with string keys, got {template_kwargs!r}")
    kwargs = {k: obj[k] for k in _SAMPLING_FIELDS if k in obj and obj[k] is not None}
    kwargs.setdefault("max_tokens", default_max_tokens)
    sampling = SamplingParams(**kwargs)
    structured = StructuredOutputsParams.from_request(obj.get("structured_output"))
    return Request(
        request_id=str(obj.get("id", index)),
        index=index,
        sampling_params=sampling,
        prompt=obj.get("prompt"),
        messages=messages,
        chat_template_kwargs=template_kwargs,
        structured_output=structured,
    )


def parse_request_lines(lines: Iterable[str], default_max_tokens: int) -> List[Request]:
    """Parse every non-blank line; a bad line yields an already-failed request."""
    requests: List[Request] = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        index = len(requests)
        obj = None
        try:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not valid JSON: {exc}") from exc
            requests.append(parse_request(obj, index, default_max_tokens))
        except (ValueError, TypeError) as exc:
            requests.append(failed_request(obj, index, f"bad request line {line_no}: {exc}"))
    return requests


def read_requests(path: str, default_max_tokens: int) -> List[Request]:
    """Read a JSON-lines requests file (see the module docstring)."""
    with open(path, encoding="utf-8") as f:
        return parse_request_lines(f, default_max_tokens)


def write_outputs(path: str, outputs: Iterable[RequestOutput]) -> None:
    """Write one JSON line per output, atomically (temporary file + rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tpguide-", suffix=".jsonl.tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would outlive the rename
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for out in outputs:
                f.write(json.dumps(out.to_json(), ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
