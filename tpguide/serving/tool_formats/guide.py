"""The guide of a tool plan: one structural tag per format and ``tool_choice``, for xgrammar or as Lark.

==============  ================================================================
``auto``        free text; the trigger starts calls (one list in list formats)
``required``    calls only, at least one, joined by the format's separator
named           exactly one call of that function
==============  ================================================================

``parallel_tool_calls=false`` allows one call at most.  Each call is a
``tag`` whose begin is the forced header (call opening, name, arguments
key), whose content is the tool's ``parameters`` schema and whose end
closes the call.  For a format xgrammar knows (``xgrammar_model``) the call
tags are xgrammar's own (:func:`xgrammar.get_model_structural_tag`, one
forced tool at a time); they must spell the header as the format table
does, else ``ValueError`` (the parser would not read the guide's calls).
Arguments follow the JSON whitespace mode (``--json-whitespace``,
:mod:`tpguide.guided.params`) as a ``max_whitespace_cnt``: ``bounded`` at
most :data:`~tpguide.guided.params.MAX_BOUNDED_WHITESPACE` characters
between tokens, ``compact`` at most one (xgrammar's least), ``any`` no
limit; so a model cannot write whitespace until ``max_tokens``.

A marker that is a control token of the tokenizer (``fmt.controls``,
:mod:`~tpguide.serving.tool_formats.control_tokens`) is a ``token`` node
of its id, never text: a tag whose begin or end holds one begins or ends
with that token and carries the text around it in its content, and in
``auto`` such a trigger is a ``token_triggered_tags`` trigger.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Dict, List, Optional, Sequence, Union

from tpguide.guided.params import MAX_BOUNDED_WHITESPACE, check_whitespace_mode
from tpguide.serving.tool_formats.call_format import CallFormat
from tpguide.serving.tool_formats.control_tokens import Controls, split_controls
from tpguide.serving.tool_formats.lark import structural_tag_to_lark

#: ``max_whitespace_cnt`` of the arguments per JSON whitespace mode.
MAX_WHITESPACE = {"compact": 1, "bounded": MAX_BOUNDED_WHITESPACE, "any": None}


@functools.lru_cache(maxsize=256)
def _xgrammar_call_tag(model: str, name: str, parameters_json: str, most: Optional[int]) -> str:
    import xgrammar

    spec = {"type": "function", "function": {"name": name, "parameters": json.loads(parameters_json)}}
    tag = xgrammar.get_model_structural_tag(model, tools=[spec], tool_choice={"type": "function",
                                                                              "function": {"name": name}},
                                            reasoning="disabled", max_whitespace_cnt=most)
    return json.dumps(tag.model_dump(mode="json", exclude_none=True)["format"])


def call_tag(fmt: CallFormat, name: str, parameters: Dict[str, Any], whitespace: str = "bounded") -> Dict[str, Any]:
    """The structural-tag ``tag`` of one call of ``name`` with arguments valid for ``parameters``.

    Raises
    ------
    ValueError
        xgrammar's tag for ``fmt.xgrammar_model`` spells the call differently from the table.
    """
    most = MAX_WHITESPACE[check_whitespace_mode(whitespace)]
    if fmt.xgrammar_model is None or fmt.controls:  # xgrammar's tags write every marker as text
        content = {"type": "json_schema", "json_schema": parameters}
        if most is not None:
            content["max_whitespace_cnt"] = most
        return tag_node(fmt.call_prefix(name), content, fmt.call_suffix, fmt.controls)
    tag = json.loads(_xgrammar_call_tag(fmt.xgrammar_model, name, json.dumps(parameters, sort_keys=True), most))
    want = (fmt.call_prefix(name), fmt.call_suffix)
    if tag.get("type") != "tag" or (tag["begin"], tag["end"]) != want:
        raise ValueError(f"xgrammar's {fmt.xgrammar_model!r} call is {tag.get('begin')!r} ... {tag.get('end')!r}, "
                         f"the {fmt.name!r} format writes {want[0]!r} ... {want[1]!r}")
    return tag


def plan_structural_tag(fmt: CallFormat, mode: str, tools: Sequence[Any], parallel: bool,
                        whitespace: str = "bounded") -> Dict[str, Any]:
    """The structural tag for ``mode`` in {"auto", "required", "named"} over ``tools`` (``FunctionTool``)."""
    tags: List[Dict[str, Any]] = [call_tag(fmt, t.name, t.parameters, whitespace) for t in tools]
    if mode == "named":
        calls: Dict[str, Any] = tags[0]
    else:
        calls = {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator, "at_least_one": True,
                 "stop_after_first": not parallel}
    if fmt.block_open:
        calls = tag_node(fmt.block_open, calls, fmt.block_close, fmt.controls)
    if mode == "auto":
        triggered = [calls] if fmt.block_open else tags
        stop = bool(fmt.block_open) or not parallel
        trigger = split_controls(fmt.trigger, fmt.controls)
        if isinstance(trigger[0], int):
            calls = {"type": "token_triggered_tags", "trigger_tokens": [trigger[0]], "tags": triggered,
                     "at_least_one": False, "stop_after_first": stop}
        elif len(trigger) > 1:
            raise ValueError(f"{fmt.name}: the trigger {fmt.trigger!r} has a control token after text; not supported")
        else:
            calls = {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": triggered, "at_least_one": False,
                     "stop_after_first": stop}
    return {"type": "structural_tag", "format": calls}


def _node(piece: Union[str, int]) -> Dict[str, Any]:
    if isinstance(piece, int):
        return {"type": "token", "token": piece}
    return {"type": "const_string", "value": piece}


def tag_node(begin: str, content: Dict[str, Any], end: str, controls: Controls = ()) -> Dict[str, Any]:
    """The structural-tag ``tag`` ``begin content end``, its control markers as ``token`` nodes.

    A ``tag``'s begin and end are one string or one token, so a begin such
    as ``[TOOL_CALLS] [`` becomes begin ``token([TOOL_CALLS])`` with `` [``
    moved to the front of the content (a ``sequence``); likewise for an end.
    """
    head, tail = split_controls(begin, controls), split_controls(end, controls)
    if all(isinstance(p, str) for p in head + tail):
        return {"type": "tag", "begin": begin, "content": content, "end": end}

    def edge(piece: Union[str, int]) -> Union[str, Dict[str, Any]]:
        return _node(piece) if isinstance(piece, int) else piece

    inner = [_node(p) for p in head[1:]] + [content] + [_node(p) for p in tail[:-1]]
    return {"type": "tag", "begin": edge(head[0]) if head else "",
            "content": inner[0] if len(inner) == 1 else {"type": "sequence", "elements": inner},
            "end": edge(tail[-1]) if tail else ""}


def plan_guide(fmt: CallFormat, mode: str, tools: Sequence[Any], parallel: bool, backend: str,
               whitespace: str = "bounded") -> Dict[str, Any]:
    """The request line's ``structured_output``: the structural tag (xgrammar) or its Lark form (llguidance)."""
    tag = plan_structural_tag(fmt, mode, tools, parallel, whitespace)
    if backend == "llguidance":
        return {"grammar": structural_tag_to_lark(tag)}
    return {"structural_tag": tag}
