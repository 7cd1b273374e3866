"""Tool-call formats without a model: guides on both backends, parsing and streaming, the choice of format.

Per format (hermes, qwen3, llama3_json, mistral, phi4_mini_json): the guide
of ``required`` / named / ``auto`` accepts the format's own calls and
nothing else, on xgrammar (structural tag) and llguidance (its Lark form);
the parser and the stream read the same calls; xgrammar's own tags agree
with the table.  ``--tool-call-parser auto`` per family and template, and
its startup errors.  The fail-closed check of a ``tool_calls`` finish.
"""

from __future__ import annotations

import copy
import json

import pytest
import xgrammar
from guided_testing import load_test_backend
from tool_format_testing import FAMILIES, GEMMA2, LLAMA31, MISTRAL, PHI4_MINI, QWEN, STYLES, family_tokenizer

from tpguide.guided import StructuredOutputsParams
from tpguide.serving.protocol import parse_request
from tpguide.serving.tool_calls import parse_tool_output, plan_tools, tool_call_error, tool_guide
from tpguide.serving.tool_formats import FORMATS, ToolSetup, choose_tool_format
from tpguide.serving.tool_formats.choose import rendered_call_format
from tpguide.serving.tool_formats.guide import call_tag
from tpguide.serving.tool_formats.lark import structural_tag_to_lark
from tpguide.serving.tool_stream import ToolCallStream

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"], "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "get_time"}}
W, T = ("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": 2}')


def accepts(backend_name, guide, text, tokenizer):
    """True if the guide's matcher accepts ``text``'s tokens and may then stop."""
    backend = load_test_backend(backend_name, 49152)
    matcher = backend.matcher(backend.compile(StructuredOutputsParams.from_request(guide)))
    for t in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.accept_token(t):
            return False
    return matcher.accept_token(backend.stop_token_ids[0]) or matcher.is_terminated()


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_forces_its_own_calls(name, backend, tokenizer):
    fmt = FORMATS[name]
    if backend == "llguidance" and not fmt.json_arguments:
        with pytest.raises(ValueError, match="style 'qwen_xml'"):
            tool_guide(plan_tools([WEATHER, TIME], "required", None, fmt), backend)
        return

    def guide(choice, parallel=None):
        return tool_guide(plan_tools([WEATHER, TIME], choice, parallel, fmt), backend)

    one, two = fmt.render_calls([W]), fmt.render_calls([W, T])
    required = guide("required")
    assert accepts(backend, required, one, tokenizer) and accepts(backend, required, two, tokenizer)
    assert not accepts(backend, required, "Hello", tokenizer)
    assert not accepts(backend, required, fmt.render_calls([("get_time", '{"zone": "x"}')]), tokenizer)
    assert not accepts(backend, required, fmt.render_calls([("rm_rf", '{"city": "x"}')]), tokenizer)
    assert not accepts(backend, required, hermes_or_llama(name).render_calls([W]), tokenizer)  # a foreign syntax
    single = guide("required", parallel=False)
    assert accepts(backend, single, one, tokenizer) and not accepts(backend, single, two, tokenizer)
    named = guide(NAMED)
    assert accepts(backend, named, fmt.render_calls([T]), tokenizer)
    assert not accepts(backend, named, one, tokenizer) and not accepts(backend, named, '{"zone": 2}', tokenizer)
    auto = guide("auto")
    assert accepts(backend, auto, "Just text.", tokenizer)
    assert accepts(backend, auto, "Let me look. " + one, tokenizer)
    assert not accepts(backend, auto, "See " + fmt.render_calls([("get_time", '{"zone": "x"}')]), tokenizer)


def hermes_or_llama(name):
    """A format whose calls the format ``name`` must refuse."""
    return FORMATS["llama3_json" if name in ("hermes", "qwen3") else "hermes"]


@pytest.mark.parametrize("name", [n for n in sorted(FORMATS) if FORMATS[n].xgrammar_model])
def test_xgrammar_formats_agree_with_the_table(name):
    """The tags come from ``xgrammar.get_model_structural_tag`` and spell the header and trigger as the parser reads."""
    fmt = FORMATS[name]
    tag = call_tag(fmt, "get_time", TIME["function"]["parameters"])  # raises if xgrammar spells it otherwise
    assert tag["begin"] == fmt.call_prefix("get_time") and tag["end"] == fmt.call_suffix
    auto = xgrammar.get_model_structural_tag(fmt.xgrammar_model, tools=[TIME], reasoning="disabled")
    assert auto.model_dump(mode="json")["format"]["triggers"] == [fmt.trigger]


def replay(plan, text, step, cut=False):
    """Feed ``text`` in prefixes of ``step`` characters; content and per-call (name, arguments)."""
    s, content, calls = ToolCallStream(plan), "", {}
    for k in list(range(step, len(text), step)) + [len(text)]:
        for ev in s.feed(text[:k], final=k == len(text), cut=cut):
            d = ev.delta()
            if "content" in d:
                content += d["content"]
                continue
            call = d["tool_calls"][0]
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] = call["function"].get("name", entry[0]) if "id" in call else entry[0]
            entry[1] += call["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_parser_and_stream_read_the_same_calls(name, step):
    fmt = FORMATS[name]
    plan = plan_tools([WEATHER, TIME], "auto", None, fmt)
    text = "Let me check <b>. " + fmt.render_calls([W, T])
    content, calls = parse_tool_output(text, plan)
    assert content == "Let me check <b>." and calls == [W, T]
    streamed_content, streamed_calls = replay(plan, text, step)
    assert streamed_content.strip() == content and streamed_calls == calls
    assert parse_tool_output("no calls", plan) == ("no calls", [])
    for cut in (fmt.render_calls([W])[:-2], fmt.render_calls([W])[:len(fmt.trigger) + 5]):
        assert parse_tool_output(cut, plan, cut=True) == (None, [])  # max_tokens inside a call: no call, no syntax
        assert replay(plan, cut, step, cut=True)[0] == ""  # streamed: part of the call's arguments at most
    two = fmt.render_calls([W, T])
    opening = two.index(fmt.separator + fmt.trigger) if not fmt.block_open else None
    if opening is not None:  # the next call's opening cut after a complete call: not content
        cut = two[:opening + len(fmt.separator) + len(fmt.trigger) - 1]
        assert parse_tool_output(cut, plan, cut=True) == (None, [W])
        assert replay(plan, cut, step, cut=True) == ("", [W])
    assert parse_tool_output(fmt.render_calls([W]).replace(", ", ",  "), plan)[1] == [W]  # other spacing reads too


def _tokenizer_with(tokenizer, template):
    tok = copy.copy(tokenizer)
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("style", [0, 1], ids=["tojson", "dict-literal"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_auto_picks_the_format_of_the_family_template(name, style, tokenizer):
    """What the template writes for a call decides, not the strings of its source (``"parameters"`` is in all)."""
    arch = FAMILIES[name][0]
    template = STYLES[name][style]
    assert style == 0 or '"parameters": t.function.parameters' in template  # the source names "parameters"
    tok = family_tokenizer(tokenizer, name, template)
    setup = choose_tool_format("auto", arch, tok)
    assert setup.fmt.name == name and setup.template_tools and setup.prompt_role == "system"
    control = [(t, tok.convert_tokens_to_ids(t)) for t in ("[TOOL_CALLS]",)] if name == "mistral" else []
    assert list(setup.fmt.controls) == control  # Mistral's control token is read as its id; Qwen's <tool_call> is text
    assert choose_tool_format(name, arch, tok).fmt.name == name  # the named format that matches is accepted
    if name == "phi4_mini_json":  # its template renders no call: the tools listing decides, nothing contradicts
        assert rendered_call_format(tok) is None and choose_tool_format("hermes", arch, tok).fmt.name == "hermes"
        return
    assert rendered_call_format(tok) == ("hermes" if name == "qwen3" else name)
    with pytest.raises(ValueError, match="does not match the model's chat template"):
        choose_tool_format("hermes" if name == "llama3_json" else "llama3_json", arch, tok)


def test_auto_without_a_tool_template(tokenizer):
    smol = choose_tool_format("auto", "LlamaForCausalLM", tokenizer)  # the embedded model: ChatML, no tools
    assert smol == ToolSetup(FORMATS["hermes"], template_tools=False, prompt_role="system")
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert choose_tool_format("auto", "MistralForCausalLM", _tokenizer_with(tokenizer, plain)).fmt.name == "mistral"
    assert choose_tool_format("auto", "LlamaForCausalLM", _tokenizer_with(tokenizer, plain)).fmt.name == "llama3_json"
    gemma = choose_tool_format("auto", "Gemma2ForCausalLM", _tokenizer_with(tokenizer, GEMMA2))
    assert gemma == ToolSetup(FORMATS["hermes"], template_tools=False, prompt_role="user")
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER]}
    (line,) = parse_request(body, "chat", "r", tool_format=gemma).lines
    assert [m["role"] for m in line["messages"]] == ["user"] and "# Tools" in line["messages"][0]["content"]


def test_startup_errors(tokenizer):
    with pytest.raises(ValueError, match="must be 'auto' or one of"):
        choose_tool_format("pythonic", "LlamaForCausalLM", tokenizer)
    with pytest.raises(ValueError, match="writes mistral calls; use --tool-call-parser mistral"):
        choose_tool_format("hermes", "MistralForCausalLM", _tokenizer_with(tokenizer, MISTRAL))
    with pytest.raises(ValueError, match="writes hermes calls"):
        choose_tool_format("llama3_json", "Qwen2ForCausalLM", _tokenizer_with(tokenizer, QWEN))
    with pytest.raises(ValueError, match="apply to hermes calls, not to llama3_json"):
        choose_tool_format("auto", "LlamaForCausalLM", _tokenizer_with(tokenizer, LLAMA31), "<call>", "</call>")
    assert choose_tool_format("qwen3", "Qwen3ForCausalLM", _tokenizer_with(tokenizer, QWEN)).fmt.name == "qwen3"
    phi = choose_tool_format("auto", "Phi3ForCausalLM", _tokenizer_with(tokenizer, PHI4_MINI))
    assert phi.fmt.name == "phi4_mini_json"


def test_template_gets_the_tools_and_structured_history(tokenizer):
    setup = choose_tool_format("auto", "LlamaForCausalLM", _tokenizer_with(tokenizer, LLAMA31))
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    body = {"model": "m", "messages": history, "tools": [WEATHER, TIME], "tool_choice": NAMED}
    (line,) = parse_request(body, "chat", "r", tool_format=setup).lines
    assert line["chat_template_kwargs"] == {"tools": [WEATHER, TIME]}  # every tool, also for a named choice
    assert line["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert line["messages"][2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    text = _tokenizer_with(tokenizer, LLAMA31).apply_chat_template(
        line["messages"], add_generation_prompt=True, tokenize=False, **line["chat_template_kwargs"])
    assert '"name": "get_time"' in text and '{"name": "get_weather", "parameters": {"city": "Oslo"}}' in text
    assert "# Tools" not in text  # not tpguide's own prompt


def test_fail_closed_check_of_a_tool_calls_finish():
    fmt = FORMATS["mistral"]
    named = plan_tools([WEATHER, TIME], NAMED, None, fmt)
    assert tool_call_error(fmt.render_calls([T]), named) is None
    assert "without a complete mistral tool call" in tool_call_error("text", named)
    assert "fail its parameters" in tool_call_error(fmt.render_calls([("get_time", '{"zone": "x"}')]), named)
    assert "not among the tools" in tool_call_error(fmt.render_calls([("nope", "{}")]), named)
    single = plan_tools([WEATHER, TIME], "required", False, fmt)
    assert "2 calls" in tool_call_error(fmt.render_calls([W, T]), single)
    assert tool_call_error("free text", plan_tools([WEATHER], "auto", None, fmt)) is None
    assert len(fmt.new_call_id()) == 9 and FORMATS["hermes"].new_call_id().startswith("call_")


def test_lark_translation_refuses_what_it_cannot_express():
    with pytest.raises(ValueError, match="node type 'regex'"):
        structural_tag_to_lark({"type": "structural_tag", "format": {"type": "regex", "pattern": "a"}})
    with pytest.raises(ValueError, match="style 'qwen_xml'"):
        structural_tag_to_lark({"type": "structural_tag", "format": {
            "type": "json_schema", "json_schema": {}, "style": "qwen_xml"}})
    assert json.loads(structural_tag_to_lark({"type": "structural_tag", "format": {
        "type": "json_schema", "json_schema": {"type": "object"}}}).split("%json ", 1)[1].split("\n")[0]) == {
            "type": "object"}
