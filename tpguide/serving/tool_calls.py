"""Tools: validated function specs, the tool prompt, the grammar that forces calls, parsing calls.

A tool call is written in the chat format's call syntax, hermes-style by
default (configurable begin/end tags)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice`` becomes a guide (``structured_output``) of the request line:

==============  ==============================================================
``"none"``      no tools in the prompt, no guide
``"auto"``      triggered by the begin tag: free text, and each call's
                arguments valid for that tool's ``parameters``
``"required"``  one or more calls and nothing else
named           the output is that function's arguments (JSON schema of its
                ``parameters``), as vLLM does
==============  ==============================================================

``parallel_tool_calls=false`` allows one call at most.  xgrammar gets its
structural tags, llguidance a Lark grammar with ``%json`` (a lazy lexeme up
to the begin tag for ``auto``).  The begin string of a call names the
function, so the guide also forces a listed name.  Sources: vLLM's hermes tool parser and its
structural-tag tool calling; xgrammar's structural-tag formats.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tpguide.serving.errors import bad_request, unsupported

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
class ToolCallFormat:
    """The call syntax: ``begin`` + newline + ``{"name": N, "arguments": A}`` + newline + ``end``."""

    begin: str = "<tool_call>"
    end: str = "</tool_call>"

    def __post_init__(self) -> None:
        if not self.begin or not self.end:
            raise ValueError(f"tool-call begin and end tags must be non-empty, got {self.begin!r}, {self.end!r}")

    def call_prefix(self, name: str) -> str:
        return f'{self.begin}\n{{"name": {json.dumps(name)}, "arguments": '

    @property
    def call_suffix(self) -> str:
        return f"}}\n{self.end}"

    def render_call(self, name: str, arguments: str) -> str:
        return self.call_prefix(name) + arguments + self.call_suffix


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools: ``mode`` in ``{"auto", "required", "named"}``."""

    mode: str
    tools: Tuple[FunctionTool, ...]
    fmt: ToolCallFormat
    parallel: bool = True

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
        if any(f.name == name for f in out):
            raise bad_request(f"tools lists the function {name!r} twice", "tools")
        desc = fn.get("description")
        out.append(FunctionTool(name, desc if isinstance(desc, str) else None, params))
    return out


def plan_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any, fmt: ToolCallFormat) -> Optional[ToolPlan]:
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
        return ToolPlan(choice, tuple(funcs), fmt, parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        match = [f for f in funcs if f.name == name]
        if not match:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in tools "
                              f"{[f.name for f in funcs]}", "tool_choice")
        return ToolPlan("named", (match[0],), fmt, parallel)
    raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                      f"{{'name': ...}}}}, got {choice!r}", "tool_choice")


def tool_system_prompt(plan: ToolPlan) -> str:
    """The text that tells the model its tools and the call syntax (added to the system message)."""
    specs = "\n".join(json.dumps(f.spec(), ensure_ascii=False) for f in plan.tools)
    fmt = plan.fmt
    return (
        "# Tools\n\nYou can call the functions listed between <tools> and </tools> to help answer the user.\n"
        f"<tools>\n{specs}\n</tools>\n\n"
        f"To call a function, write a JSON object with its name and arguments between {fmt.begin} and "
        f"{fmt.end}:\n{fmt.begin}\n{{\"name\": <function name>, \"arguments\": <arguments object>}}\n{fmt.end}"
    )


def tool_guide(plan: ToolPlan, backend: str) -> Dict[str, Any]:
    """The ``structured_output`` object of the request line that enforces ``plan``.

    xgrammar gets its structural tags (``triggered_tags`` for ``auto``,
    ``tags_with_separator`` for ``required``), llguidance a Lark grammar.
    """
    fmt = plan.fmt
    if plan.mode == "named":
        return {"json": plan.tools[0].parameters}
    if backend == "llguidance":
        return {"grammar": _llguidance_lark(plan)}
    tags = [{"type": "tag", "begin": fmt.call_prefix(f.name),
             "content": {"type": "json_schema", "json_schema": f.parameters}, "end": fmt.call_suffix}
            for f in plan.tools]
    if plan.mode == "auto":
        body = {"type": "triggered_tags", "triggers": [fmt.begin], "tags": tags,
                "at_least_one": False, "stop_after_first": not plan.parallel}
    else:
        body = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                "at_least_one": True, "stop_after_first": not plan.parallel}
    return {"structural_tag": {"type": "structural_tag", "format": body}}


def _llguidance_lark(plan: ToolPlan) -> str:
    """Lark (llguidance) for ``auto`` or ``required``.

    ``auto``: text without the begin tag, or text up to the first begin tag
    (a lazy lexeme) followed by a valid call, repeated.  ``required``: calls
    separated by newlines.  ``%json`` embeds each tool's parameters schema.
    """
    fmt = plan.fmt
    begin = re.escape(fmt.begin).replace("/", "\\/")
    calls = " | ".join(f"call_{i}" for i in range(len(plan.tools)))
    if plan.mode == "auto":
        lines = ["start: (pre call)* TAIL" if plan.parallel else "start: (pre call)? TAIL",
                 f"pre[lazy]: /(.|\\n)*{begin}/",
                 f"TAIL: /(.|\\n)*/ & ~/(.|\\n)*{begin}(.|\\n)*/",
                 f"call: {calls}"]
        cut = len(fmt.begin)  # the begin tag is matched by ``pre``
    else:
        lines = ['start: call ("\\n" call)*' if plan.parallel else "start: call", f"call: {calls}"]
        cut = 0
    for i, f in enumerate(plan.tools):
        prefix = fmt.call_prefix(f.name)[cut:]
        lines.append(f"call_{i}: {json.dumps(prefix)} %json {json.dumps(f.parameters)} {json.dumps(fmt.call_suffix)}")
    return "\n".join(lines) + "\n"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_output(text: str, plan: ToolPlan) -> Tuple[Optional[str], List[Tuple[str, str]]]:
    """Split a finished output into (content, [(function name, arguments JSON text)]).

    ``named``: the whole text is the arguments.  Otherwise every complete
    ``begin {"name": ..., "arguments": ...} end`` block is a call and the
    rest is content (None when only whitespace).  An incomplete trailing
    block (the output hit ``max_tokens``) stays in the content.
    """
    if plan.mode == "named":
        return None, [(plan.tools[0].name, text)]
    calls: List[Tuple[str, str]] = []
    content: List[str] = []
    pos = 0
    for start, end, name, args in find_calls(text, plan.fmt):
        content.append(text[pos:start])
        calls.append((name, args))
        pos = end
    content.append(text[pos:])
    joined = "".join(content).strip()
    return (joined or None), calls


_HEADER = r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*'


def header_regex(fmt: ToolCallFormat) -> "re.Pattern[str]":
    """Matches ``begin {"name": "N", "arguments": `` (group 1: the name as JSON string content)."""
    return re.compile(re.escape(fmt.begin) + _HEADER)


def find_calls(text: str, fmt: ToolCallFormat) -> Sequence[Tuple[int, int, str, str]]:
    """Complete calls in ``text``: ``(start, end, name, arguments text)``, in order."""
    header, decoder, out = header_regex(fmt), json.JSONDecoder(), []
    tail = re.compile(r"\s*\}\s*" + re.escape(fmt.end))
    pos = 0
    while True:
        m = header.search(text, pos)
        if m is None:
            return out
        try:
            _, args_end = decoder.raw_decode(text, m.end())
        except json.JSONDecodeError:
            return out
        t = tail.match(text, args_end)
        if t is None:
            return out
        out.append((m.start(), t.end(), json.loads(f'"{m.group(1)}"'), text[m.end():args_end]))
        pos = t.end()
