"""An OpenAI request body -> request-line dicts (docs/usage.md "Running your own requests"), one per choice.

The server goes through :func:`tpguide.engine.request_io.request_from_dict`
with these dicts, so validation and its messages are the offline path's.
Every field is in one of three tables: mapped onto the request line,
accepted because it does not change the output (``user``, ``metadata``,
...), or refused with a 400 naming it.  Unknown fields are refused too: a
field that would change the output is never ignored.

Defaults follow OpenAI: ``temperature`` 1, ``top_p`` 1, ``n`` 1.
``max_tokens`` defaults to the server's ``--max-new-tokens``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from tpguide.serving.chat_messages import render_messages
from tpguide.serving.errors import bad_request, unsupported
from tpguide.serving.reasoning_fields import (
    CHAT_REASONING_FIELDS,
    COMPLETION_REASONING_FIELDS,
    include_reasoning,
    reasoning_line_fields,
)
from tpguide.serving.tool_answer import ANY_OBJECT
from tpguide.serving.tool_calls import ToolPlan, parse_tools, plan_tools, tool_guide, tool_system_prompt
from tpguide.serving.tool_formats import CallFormat, ToolSetup, hermes

#: Fields that do not change what is generated; accepted and not used.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                            "prompt_cache_retention", "prompt_cache_options", "request_id", "priority"})
_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
                     "stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                     "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "response_format", "ignore_eos", "logprobs", "return_token_ids",
                     "return_receipt"})  # return_receipt: read by the app (tpguide/serving/receipts.py)
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls", "modalities"} | CHAT_REASONING_FIELDS
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"} | COMPLETION_REASONING_FIELDS
#: Legacy vLLM fields -> keys of the request line's ``structured_output``.
LEGACY_GUIDES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
#: Penalties and their neutral values (a neutral value is the same as not setting the field).
PENALTIES = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {}}
MAX_N = 16


@dataclass(frozen=True)
class ParsedRequest:
    """What the server needs to run one HTTP request and build its answer.

    Attributes
    ----------
    endpoint : {"chat", "completion"}
    model : str
    lines : list of dict
        Request-line dicts, prompt-major then choice: ``lines[p * n + j]``.
    n : int
        Choices per prompt.
    stream, include_usage : bool
    logprobs : int or None
        Top alternatives per token to report; None = no logprobs in the answer.
    tools : ToolPlan or None
    return_token_ids : bool
        vLLM's extension: each choice also carries its generated ``token_ids``.
    include_reasoning : bool
        A reasoning model's ``message.reasoning`` is returned (docs/reasoning.md).
    """

    endpoint: str
    model: str
    lines: List[Dict[str, Any]]
    n: int
    stream: bool
    include_usage: bool
    logprobs: Optional[int]
    tools: Optional[ToolPlan]
    return_token_ids: bool = False
    include_reasoning: bool = True


def _int_field(body: Dict[str, Any], name: str, lo: int, hi: int) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise bad_request(f"{name} must be an int in [{lo}, {hi}], got {v!r}", name)
    return v


def _reject_unknown(body: Dict[str, Any], allowed: frozenset) -> None:
    for key in body:
        if key not in allowed and key not in IGNORED_FIELDS:
            raise unsupported(key, "not an OpenAI field tpguide knows")


def _response_format_guide(rf: Any) -> Optional[Dict[str, Any]]:
    """``response_format`` -> its ``structured_output`` (None for ``text`` or absent); 400 naming the field."""
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise bad_request("response_format.json_schema needs a 'schema' (and a 'name')",
                              "response_format.json_schema")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(f"response_format.json_schema.strict must be true or false, got {strict!r}",
                              "response_format.json_schema.strict")
        # OpenAI's strict: false is best effort (docs/guarantees.md "Best effort"); absent or true is strict
        return {"json": js["schema"], **({"strict": False} if strict is False else {})}
    if kind != "text":
        raise bad_request(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          "response_format")
    return None


def _tools_with_answer(body: Dict[str, Any], tools: Optional[ToolPlan]) -> tuple:
    """(plan, rest of the guide sources) when ``tools`` and a JSON ``response_format`` come together.

    ``tool_choice`` auto: one guide, calls or a schema answer (:mod:`tpguide.serving.tool_answer`);
    required / named: the output is calls only and the schema never applies.
    """
    answer = _response_format_guide(body.get("response_format")) if tools is not None else None
    if answer is None:
        return tools, body
    rest = {k: v for k, v in body.items() if k != "response_format"}
    if tools.mode != "auto":
        return tools, rest
    schema = answer["json"] if "json" in answer else ANY_OBJECT
    if not isinstance(schema, dict):
        raise bad_request(f"response_format.json_schema.schema must be an object with tools, got "
                          f"{type(schema).__name__}", "response_format.json_schema.schema")
    return dataclasses.replace(tools, answer_schema=schema), rest


def _guide(body: Dict[str, Any], tools: Optional[ToolPlan], backend: str) -> Optional[Dict[str, Any]]:
    """The one ``structured_output`` the request asks for (400 if it asks for two)."""
    sources: List[tuple] = []
    rf = _response_format_guide(body.get("response_format"))
    if rf is not None:
        sources.append(("response_format", rf))
    so = body.get("structured_outputs")
    if so is not None:
        sources.append(("structured_outputs", so))
    for field, key in LEGACY_GUIDES.items():
        if body.get(field) is not None:
            sources.append((field, {key: body[field]}))
    if tools is not None:
        sources.append(("tools", tool_guide(tools, backend)))
    if len(sources) > 1:
        raise bad_request(f"only one structured-output constraint per request, got {[s[0] for s in sources]}",
                          sources[1][0])
    return sources[0][1] if sources else None


def _stream_options(body: Dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not body.get("stream"):
        raise bad_request("stream_options is only allowed with stream=true", "stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise bad_request(f"stream_options may hold include_usage only, got {opts!r}", "stream_options")
    if opts.get("continuous_usage_stats"):
        raise unsupported("stream_options.continuous_usage_stats")
    return bool(opts.get("include_usage"))


def _sampling_fields(body: Dict[str, Any], endpoint: str) -> Dict[str, Any]:
    line: Dict[str, Any] = {"temperature": 1.0, "top_p": 1.0}
    for key in ("temperature", "top_p", "top_k", "seed", "ignore_eos", "stop"):
        if body.get(key) is not None:
            line[key] = body[key]
    max_tokens = body.get("max_completion_tokens") if endpoint == "chat" else None
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        line["max_tokens"] = max_tokens
    if isinstance(line.get("stop"), str):
        line["stop"] = [line["stop"]]
    if line.get("stop") == []:
        del line["stop"]
    for key, neutral in PENALTIES.items():
        if body.get(key) is not None and body[key] != neutral:
            line[key] = body[key]
    return line


def _logprobs(body: Dict[str, Any], endpoint: str) -> Optional[int]:
    if endpoint == "completion":
        return _int_field(body, "logprobs", 0, 20)
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise bad_request(f"logprobs must be true or false, got {lp!r}", "logprobs")
    top = _int_field(body, "top_logprobs", 0, 20)
    if top is not None and not lp:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    return (top or 0) if lp else None


def _completion_prompts(body: Dict[str, Any]) -> List[str]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        raise unsupported("prompt", "token-id prompts (send text)")
    raise bad_request(f"prompt must be a string or a non-empty list of strings, got {type(prompt).__name__}",
                      "prompt")


def parse_request(body: Any, endpoint: str, request_id: str, backend: str = "xgrammar",
                  tool_format: Optional[Union[ToolSetup, CallFormat]] = None) -> ParsedRequest:
    """Map an OpenAI ``/v1/chat/completions`` or ``/v1/completions`` body onto request lines.

    Parameters
    ----------
    body : dict
        The decoded JSON body.
    endpoint : {"chat", "completion"}
    request_id : str
        The response id; line ``k`` gets id ``f"{request_id}-{k}"``.
    backend : {"xgrammar", "llguidance"}
        The server's guided backend (tool grammars differ).
    tool_format : ToolSetup or CallFormat, optional
        The server's call format (and whether its chat template renders
        tools, docs/tool-calls.md).  Default: hermes, tools in tpguide's prompt.

    Raises
    ------
    APIError
        400 on a malformed or unsupported field (the message names it).
        Values the request line validates (sampling ranges, guides) are
        checked later by ``request_from_dict``.
    """
    setup = tool_format if isinstance(tool_format, ToolSetup) else ToolSetup(tool_format or hermes())
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    _reject_unknown(body, CHAT_FIELDS if endpoint == "chat" else COMPLETION_FIELDS)
    if not isinstance(body.get("model"), str):
        raise bad_request("'model' is required (a string)", "model")
    n = _int_field(body, "n", 1, MAX_N) or 1
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be true or false, got {stream!r}", "stream")
    include_usage = _stream_options(body)
    logprobs = _logprobs(body, endpoint)
    if endpoint == "completion":
        if body.get("echo"):
            raise unsupported("echo")
        if body.get("suffix") is not None:
            raise unsupported("suffix")
        if body.get("best_of") not in (None, n):
            raise unsupported("best_of", "only best_of == n")
        tools = None
        prompts = [{"prompt": p} for p in _completion_prompts(body)]
    else:
        if body.get("modalities") not in (None, ["text"]):
            raise unsupported("modalities", "text only")
        tools = plan_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"),
                           setup.fmt, setup.json_whitespace)
        if setup.template_tools:  # the model's own template shows the tools (all of them, as vLLM does)
            messages = render_messages(body.get("messages"), setup.fmt, template_tools=True)
            specs = {"tools": [f.spec() for f in parse_tools(body["tools"])]} if tools is not None else {}
            prompts = [{"messages": messages, **({"chat_template_kwargs": specs} if specs else {})}]
        else:
            prompt = tool_system_prompt(tools) if tools is not None else None
            prompts = [{"messages": render_messages(body.get("messages"), setup.fmt, prompt,
                                                    prompt_role=setup.prompt_role)}]
    base = {**_sampling_fields(body, endpoint), **reasoning_line_fields(body)}
    if logprobs is not None:  # the engine records logprobs for logprobs >= 1; 0 alternatives are cut later
        base["logprobs"] = max(logprobs, 1)
    tools, guide_body = _tools_with_answer(body, tools)
    guide = _guide(guide_body, tools, backend)
    if guide is not None:
        base["structured_output"] = guide
    lines = []
    for p in prompts:
        for j in range(n):
            line = {"id": f"{request_id}-{len(lines)}", **p, **base}
            if "chat_template_kwargs" in p and "chat_template_kwargs" in base:  # the tools and the request's own
                line["chat_template_kwargs"] = {**base["chat_template_kwargs"], **p["chat_template_kwargs"]}
            if j > 0 and line.get("seed") is not None:
                line["seed"] = derived_seed(line["seed"], j)
            lines.append(line)
    return_ids = body.get("return_token_ids") or False
    if not isinstance(return_ids, bool):
        raise bad_request(f"return_token_ids must be true or false, got {return_ids!r}", "return_token_ids")
    return ParsedRequest(endpoint, body["model"], lines, n, stream, include_usage, logprobs, tools, return_ids,
                         include_reasoning=include_reasoning(body))


def derived_seed(seed: Any, choice: int) -> Any:
    """Seed of choice ``j > 0`` of a seeded request (choice 0 keeps the seed, so n=1 is its first choice)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        return seed  # request_from_dict reports the bad value
    return (seed * 1_000_003 + choice) % (2**63 - 1)
