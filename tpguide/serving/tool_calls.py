"""Tools: validated function specs, the tool prompt, the guide that forces calls, parsing calls.

A tool call is written in the call syntax of the server's format
(``--tool-call-parser``, :mod:`tpguide.serving.tool_formats`), hermes by
default::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice`` becomes a guide (``structured_output``) of the request line
(:mod:`tpguide.serving.tool_formats.guide`):

==============  ==============================================================
``"none"``      no tools in the prompt, no guide
``"auto"``      triggered by the format's trigger: free text, and each call's
                arguments valid for that tool's ``parameters``
``"required"``  one or more calls and nothing else
named           exactly one call of that function
==============  ==============================================================

``parallel_tool_calls=false`` allows one call at most.  xgrammar gets a
structural tag, llguidance the same tag as a Lark grammar.  The header of a
call names the function, so the guide also forces a listed name.  Sources:
vLLM's tool parsers and its structural-tag tool calling; xgrammar's
``get_model_structural_tag``.  docs/tool-calls.md lists the formats.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from tpguide.guided.reasoning import THINK_END, single_token_id
from tpguide.guided.schema_check import check_valid_schema
from tpguide.serving.errors import bad_request, unsupported
from tpguide.serving.tool_answer import answer_error, answer_or_calls_guide
from tpguide.serving.tool_formats.call_format import CallFormat
from tpguide.serving.tool_formats.control_tokens import MarkerText
from tpguide.serving.tool_formats.guide import plan_guide

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class FunctionTool:
    """One ``{"type": "function", "function": {...}}`` entry of ``tools``."""

    name: str
    description: Optional[str]
    parameters: Dict[str, Any]

    def spec(self) -> Dict[str, Any]:
        fn: Dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools: ``mode`` in ``{"auto", "required", "named"}``."""

    mode: str
    tools: Tuple[FunctionTool, ...]
    fmt: CallFormat
    parallel: bool = True
    whitespace: str = "bounded"  # JSON whitespace mode of the arguments (tpguide.guided.params)
    #: auto only: an output without calls is a JSON answer valid for this schema (tpguide.serving.tool_answer)
    answer_schema: Optional[Dict[str, Any]] = None

    @property
    def schemas(self) -> Dict[str, Dict[str, Any]]:
        """``parameters`` by function name (XML formats read argument types from them)."""
        return {t.name: t.parameters for t in self.tools}

def parse_tools(tools: Any) -> List[FunctionTool]:
    """Validate ``tools``; 400 naming the bad entry."""
    if not isinstance(tools, list) or not tools:
        raise bad_request("'tools' must be a non-empty list of function tools", "tools")
    out: List[FunctionTool] = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}, got type {kind!r}",
                              f"tools[{i}]")
        fn = t["function"]
        extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if extra:
            raise unsupported(f"tools[{i}].function.{extra[0]}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"tools[{i}].function.name must match ^[A-Za-z0-9_-]{{1,64}}$, got {name!r}",
                              f"tools[{i}].function.name")
        params = fn.get("parameters") or _EMPTY_PARAMETERS
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object, got "
                              f"{type(params).__name__}", f"tools[{i}].function.parameters")
        try:
            check_valid_schema(params)  # as a response_format's schema is (a 400 naming the pointer)
        except ValueError as exc:
            raise bad_request(f"tools[{i}].function.parameters: {exc}", f"tools[{i}].function.parameters") from None
        if any(f.name == name for f in out):
            raise bad_request(f"tools lists the function {name!r} twice", "tools")
        desc = fn.get("description")
        out.append(FunctionTool(name, desc if isinstance(desc, str) else None, params))
    return out


def plan_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any, fmt: CallFormat,
               whitespace: str = "bounded") -> Optional[ToolPlan]:
    """``tools`` + ``tool_choice`` -> a :class:`ToolPlan`, or None for no tool use.

    Raises
    ------
    APIError
        400: bad tools, a ``tool_choice`` that is not ``none``/``auto``/
        ``required``/a listed function, ``tool_choice`` without ``tools``.
    """
    if tools is None:
        if tool_choice not in (None, "none"):
            raise bad_request(f"tool_choice={tool_choice!r} needs 'tools'", "tool_choice")
        return None
    funcs = parse_tools(tools)
    choice = "auto" if tool_choice is None else tool_choice
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    if not isinstance(parallel, bool):
        raise bad_request(f"parallel_tool_calls must be true or false, got {parallel!r}", "parallel_tool_calls")
    if choice == "none":
        return None
    if choice in ("auto", "required"):
        return ToolPlan(choice, tuple(funcs), fmt, parallel, whitespace)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        match = [f for f in funcs if f.name == name]
        if not match:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in tools "
                              f"{[f.name for f in funcs]}", "tool_choice")
        return ToolPlan("named", (match[0],), fmt, parallel, whitespace)
    raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                      f"{{'name': ...}}}}, got {choice!r}", "tool_choice")


def tool_system_prompt(plan: ToolPlan) -> str:
    """The text that tells the model its tools and the call syntax (added to the system message).

    The fallback for chat templates that do not render ``tools`` themselves.
    """
    specs = "\n".join(json.dumps(f.spec(), ensure_ascii=False) for f in plan.tools)
    example = plan.fmt.render_calls([("<function name>", "<arguments object>")]).replace('"<function name>"',
                                                                                          "<function name>")
    fmt = plan.fmt
    tags = (fmt.call_open.strip(), fmt.call_close.strip())
    how = f"between {tags[0]} and {tags[1]}:" if all(tags) else "like this:"
    return (
        "# Tools\n\nYou can call the functions listed between <tools> and </tools> to help answer the user.\n"
        f"<tools>\n{specs}\n</tools>\n\n"
        f"To call a function, write a JSON object with its name and arguments {how}\n{example}"
    )


def tool_guide(plan: ToolPlan, backend: str) -> Dict[str, Any]:
    """The ``structured_output`` object of the request line that enforces ``plan``."""
    if plan.answer_schema is not None:
        return answer_or_calls_guide(plan, plan.answer_schema, backend)
    return plan_guide(plan.fmt, plan.mode, plan.tools, plan.parallel, backend, plan.whitespace)


def parse_tool_output(text: str, plan: ToolPlan, cut: bool = False) -> Tuple[Optional[str], List[Tuple[str, str]]]:
    """Split a finished output into (content, [(function name, arguments JSON text)]).

    Every complete call in the format's syntax is a call and the rest is
    content (None when only whitespace).  No call syntax is content: an
    unfinished call, and with ``cut`` (the output hit ``max_tokens``) the
    start of a call cut short, go nowhere (docs/tool-calls.md).

    Parameters
    ----------
    text : str
        The answer as :func:`tool_output_text` gives it.
    """
    return plan.fmt.scan(text, True, plan.schemas).finished(cut)


def tool_output_text(plan: ToolPlan, tokenizer: Any, out: Any, final: bool = True,
                     decoder: Optional[MarkerText] = None) -> str:
    """The text of ``out`` (an engine ``RequestOutput``) that the plan's parser reads.

    ``out.text`` for a format whose markers are text; for one with control
    markers (``plan.fmt.controls``) the answer's token ids decoded with
    each marker id as its sentinel
    (:func:`~tpguide.serving.tool_formats.control_tokens.marker_text`), so
    calls are read from ids.  The answer of a thinking request is the ids
    after ``</think>``.  ``final`` False (streaming) holds back a cut character;
    a stream passes its own ``decoder`` (a :class:`MarkerText` of the plan's
    controls) so that each step decodes only what follows the last marker.
    """
    if not plan.fmt.controls:
        return out.text
    ids = list(out.token_ids)
    if getattr(out, "reasoning", None) is not None:
        end = single_token_id(tokenizer, THINK_END)
        ids = ids[ids.index(end) + 1:] if end in ids else []
    return (decoder or MarkerText(tokenizer, plan.fmt.controls)).update(ids, final)


def tool_call_error(text: str, plan: ToolPlan) -> Optional[str]:
    """Why a finished output that stopped by itself is not a valid answer to ``plan``, or None.

    Fail closed (docs/tool-calls.md): every call names a listed tool and its
    arguments are JSON valid for that tool's ``parameters``; ``required``
    and named have at least one call (named: of that function), and
    ``parallel_tool_calls=false`` at most one.  Under an ``answer_schema``
    an output without calls is JSON valid for it.
    """
    from tpguide.guided.schema_check import validator_for_schema

    _, calls = parse_tool_output(text, plan)
    if plan.answer_schema is not None and not calls:
        return answer_error(text, plan.answer_schema)
    if plan.mode != "auto" and not calls:
        return f"tool_choice {plan.mode!r} finished without a complete {plan.fmt.name} tool call: {text[:80]!r}"
    if not plan.parallel and len(calls) > 1:
        return f"parallel_tool_calls=false but the output has {len(calls)} calls"
    by_name = {t.name: t for t in plan.tools}
    for name, args in calls:
        if name not in by_name:
            return f"the output calls {name!r}, which is not among the tools {sorted(by_name)}"
        try:
            value = json.loads(args)
        except json.JSONDecodeError as exc:
            return f"the arguments of {name!r} are not JSON ({exc}): {args[:80]!r}"
        error = next(iter(validator_for_schema(by_name[name].parameters).iter_errors(value)), None)
        if error is not None:
            return f"the arguments of {name!r} fail its parameters: {error.message}"
    return None
