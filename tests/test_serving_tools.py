"""Tool calling: plans, the grammars on both backends, parsing, streamed deltas (no model)."""

from __future__ import annotations

import json

import pytest
from guided_testing import load_test_backend

from tpguide.guided import StructuredOutputsParams
from tpguide.serving.errors import APIError
from tpguide.serving.tool_calls import parse_tool_output, plan_tools, tool_guide
from tpguide.serving.tool_formats import hermes
from tpguide.serving.tool_stream import ToolCallStream

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"],
    "additionalProperties": False}}}
FMT = hermes()
CALL_W = FMT.render_call("get_weather", '{"city": "Paris"}')
CALL_T = FMT.render_call("get_time", '{"zone": 2}')


def plan(choice, parallel=None):
    return plan_tools([WEATHER, TIME], choice, parallel, FMT)


def accepts(backend_name, guide, text, tokenizer):
    """True if the guide's matcher accepts ``text``'s tokens and may then stop."""
    backend = load_test_backend(backend_name, 49152)
    matcher = backend.matcher(backend.compile(StructuredOutputsParams.from_request(guide)))
    for t in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.accept_token(t):
            return False
    return matcher.accept_token(backend.stop_token_ids[0]) or matcher.is_terminated()


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_required_forces_valid_calls_only(backend, tokenizer):
    guide = tool_guide(plan("required"), backend)
    assert accepts(backend, guide, CALL_W, tokenizer)
    assert accepts(backend, guide, CALL_W + "\n" + CALL_T, tokenizer)
    assert not accepts(backend, guide, "Hello", tokenizer)
    assert not accepts(backend, guide, FMT.render_call("get_weather", '{"city": 3}'), tokenizer)
    assert not accepts(backend, guide, FMT.render_call("rm_rf", '{"city": "x"}'), tokenizer)
    single = tool_guide(plan("required", parallel=False), backend)
    assert accepts(backend, single, CALL_T, tokenizer)
    assert not accepts(backend, single, CALL_W + "\n" + CALL_T, tokenizer)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_auto_allows_text_and_checks_calls(backend, tokenizer):
    guide = tool_guide(plan("auto"), backend)
    assert accepts(backend, guide, "Just text.", tokenizer)
    assert accepts(backend, guide, "Let me look. " + CALL_W, tokenizer)
    assert accepts(backend, guide, CALL_W + " and " + CALL_T, tokenizer)
    assert not accepts(backend, guide, FMT.render_call("get_time", '{"zone": "x"}'), tokenizer)
    assert not accepts(backend, guide, "See <tool_call>\n{\"name\": \"nope\"", tokenizer)
    single = tool_guide(plan("auto", parallel=False), backend)
    assert accepts(backend, single, "ok " + CALL_W, tokenizer)
    assert not accepts(backend, single, CALL_W + " and " + CALL_T, tokenizer)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_named_is_one_call_of_that_function(backend, tokenizer):
    p = plan({"type": "function", "function": {"name": "get_time"}})
    guide = tool_guide(p, backend)
    assert p.mode == "named"
    assert accepts(backend, guide, CALL_T, tokenizer)
    assert not accepts(backend, guide, CALL_W, tokenizer)
    assert not accepts(backend, guide, CALL_T + "\n" + CALL_T, tokenizer)
    assert not accepts(backend, guide, '{"zone": 1}', tokenizer)
    assert parse_tool_output(CALL_T, p) == (None, [("get_time", '{"zone": 2}')])


def test_plan_errors():
    with pytest.raises(APIError, match="not in tools"):
        plan({"type": "function", "function": {"name": "nope"}})
    with pytest.raises(APIError, match="needs 'tools'"):
        plan_tools(None, "required", None, FMT)
    with pytest.raises(APIError, match="twice"):
        plan_tools([WEATHER, WEATHER], "auto", None, FMT)
    assert plan("none") is None


def test_parse_output_splits_content_and_calls():
    p = plan("auto")
    content, calls = parse_tool_output("Sure. " + CALL_W + "\n" + CALL_T, p)
    assert content == "Sure." and calls == [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": 2}')]
    assert parse_tool_output("no calls", p) == ("no calls", [])
    cut = CALL_W[:-5]  # max_tokens inside the end tag: not a call, and not content either
    assert parse_tool_output("Sure. " + cut, p, cut=True) == ("Sure.", [])


def replay(p, text, step=3):
    """Feed ``text`` in prefixes of ``step`` characters; collect content and per-call name/arguments."""
    s, content, calls = ToolCallStream(p), "", {}
    for k in list(range(step, len(text), step)) + [len(text)]:
        for ev in s.feed(text[:k], final=k == len(text)):
            d = ev.delta()
            if "content" in d:
                content += d["content"]
            else:
                call = d["tool_calls"][0]
                entry = calls.setdefault(call["index"], {"name": None, "arguments": ""})
                if "id" in call:
                    entry["name"] = call["function"]["name"]
                entry["arguments"] += call["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_stream_deltas_concatenate_to_the_answer(step):
    p = plan("auto")
    text = "Let me check <b>. " + CALL_W + "\n" + CALL_T
    content, calls = replay(p, text, step)
    want_content, want_calls = parse_tool_output(text, p)
    assert content.strip() == want_content
    assert [(c["name"], c["arguments"]) for c in calls] == want_calls
    for c in calls:
        json.loads(c["arguments"])


def test_stream_named_and_plain_text():
    p = plan({"type": "function", "function": {"name": "get_time"}})
    assert replay(p, FMT.render_call("get_time", '{"zone": 12}'), 2) == ("", [{"name": "get_time",
                                                                              "arguments": '{"zone": 12}'}])
    assert replay(plan("auto"), "a <tool_ text that is not a call", 4) == ("a <tool_ text that is not a call", [])
