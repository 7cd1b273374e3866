"""Requests files (JSON lines in) and outputs (JSON lines out, crash-safe ``.partial`` stream, resume).

**Requests in.**  Request line (field names follow vLLM's structured-outputs parameters)::

    {"id": str, "messages": [{"role": ..., "content": ...}, ...] | "prompt": str,
     "structured_output": {"json": schema} | {"regex": str} | {"choice": [str]}
                          | {"grammar": str} | {"json_object": true}
                          | {"structural_tag": ...} | null,
     "max_tokens": int, "temperature": float, "top_k": int, "top_p": float,
     "seed": int, "logprobs": int, "prompt_logprobs": int | null, "ignore_eos": bool,
     "stop": [str], "presence_penalty": float, "frequency_penalty": float,
     "repetition_penalty": float, "logit_bias": {"token_id": float},
     "chat_template_kwargs": {name: value} | null,   # vLLM's name, e.g. {"enable_thinking": false}
     "thinking_token_budget": int | null}           # reasoning models (docs/reasoning.md)

A line that cannot be parsed or validated becomes a request that is already
finished with ``finish_reason="error"``: it still gets its output line, in
input order, and nothing else is affected.

**Outputs out.**  One JSON line per request (:meth:`RequestOutput.to_json`),
in input order.  Crash-safe: ``launch/generate.py --output OUT`` appends each request's line to
``OUT.partial`` the moment it finishes (one ``write`` per line, flushed and
``fsync``-ed), so a crash, a killed rank or a lost node leaves every finished
request on disk.  At the end the in-order ``OUT`` is written atomically
(temporary file + rename, :func:`write_outputs`) and the partial file removed.

``--resume`` reads ``OUT`` and ``OUT.partial`` (:func:`load_finished`) and
skips every request id found there.  Lines that finished with ``"error"`` are
kept too, not retried: they come from bad input (unknown field, invalid
schema, prompt too long, ...) or from a deterministic decoding failure (dead
end, non-finite logits at a seeded position) and would fail the same way
again; a request cut off by a crash never has a line, so it always reruns.
``--retry-errors`` reruns the error lines as well (after fixing the input).
A torn last line (the crash hit mid-write) is ignored.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Dict, Iterable, List, Optional

from tpguide.engine.request import Request, RequestOutput, SamplingParams
from tpguide.engine.text_check import check_unicode

REQUEST_FIELDS = frozenset(
    {"id", "messages", "prompt", "structured_output", "max_tokens", "temperature",
     "top_k", "top_p", "seed", "logprobs", "prompt_logprobs", "ignore_eos", "stop", "presence_penalty",
     "frequency_penalty", "repetition_penalty", "logit_bias", "chat_template_kwargs",
     "thinking_token_budget"}
)
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "logprobs", "prompt_logprobs",
                    "ignore_eos", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty",
                    "logit_bias", "thinking_token_budget")


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
    check_unicode(obj)  # a lone surrogate would make the tokenizer raise (tpguide/engine/text_check.py)
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


# ------------------------------------------------------------------ the .partial stream, --resume

def partial_path(output_path: str) -> str:
    """Where finished requests are streamed while ``output_path`` is being produced."""
    return output_path + ".partial"


class PartialWriter:
    """Append-only, fsync-per-line writer of finished outputs (driver only).

    Parameters
    ----------
    path : str
        The ``.partial`` file.
    append : bool
        Keep its lines (a resumed run); otherwise start it empty.
    """

    def __init__(self, path: str, append: bool = False) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._f = open(path, "a" if append else "w", encoding="utf-8")

    def __call__(self, output: RequestOutput) -> None:
        """Append one output line and make it durable before returning."""
        self._f.write(json.dumps(output.to_json(), ensure_ascii=False) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self, remove: bool = False) -> None:
        """Close; ``remove=True`` once the final output file is in place."""
        self._f.close()
        if remove and os.path.exists(self.path):
            os.unlink(self.path)


def _read_lines(path: str, done: Dict[str, Dict[str, Any]]) -> None:
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash mid-write: that request reruns
            if isinstance(obj, dict) and "id" in obj and "finish_reason" in obj:
                done[str(obj["id"])] = obj


def load_finished(output_path: str, retry_errors: bool = False) -> Dict[str, Dict[str, Any]]:
    """Finished outputs on disk by request id: ``output_path``, then its ``.partial``.

    Parameters
    ----------
    retry_errors : bool
        Leave out lines with ``finish_reason == "error"`` (they rerun).
    """
    done: Dict[str, Dict[str, Any]] = {}
    _read_lines(output_path, done)
    _read_lines(partial_path(output_path), done)
    if retry_errors:
        done = {k: v for k, v in done.items() if v.get("finish_reason") != "error"}
    return done


def open_partial(output_path: Optional[str], append: bool = False) -> Optional[PartialWriter]:
    """A :class:`PartialWriter` next to ``output_path``, or None without an output file."""
    return PartialWriter(partial_path(output_path), append) if output_path else None
