"""Format markers that are control tokens (Mistral's ``[TOOL_CALLS]``): forced as ids on both backends, read from ids.

The tokenizer gets the control tokens as Mistral's does: special in
``added_tokens_decoder``, not in ``additional_special_tokens``.
"""

from __future__ import annotations

import copy
import functools

import pytest
from tool_format_testing import FAMILY_TOKENS, MISTRAL, QWEN, TIME, WEATHER, family_tokenizer
from transformers import AddedToken

from tpguide.guided import StructuredOutputsParams, make_backend
from tpguide.guided.bitmask import allocate_token_bitmask, unpack_bitmask
from tpguide.model.tokenizer_facts import collect_stop_token_ids
from tpguide.serving.tool_calls import parse_tool_output, plan_tools, tool_call_error, tool_guide
from tpguide.serving.tool_formats import choose_tool_format
from tpguide.serving.tool_formats.control_tokens import marker_text
from tpguide.serving.tool_stream import ToolCallStream

PADDED = 49216  # 49152 + the added tokens, padded to 64
NAMED = {"type": "function", "function": {"name": "get_time"}}
W, T = ("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", '{"zone": 2}')


@functools.lru_cache(maxsize=None)
def _backend(name, tok):
    return make_backend(name, tok, PADDED, collect_stop_token_ids(tok))


def _matcher(name, tok, guide):
    backend = _backend(name, tok)
    return backend, backend.matcher(backend.compile(StructuredOutputsParams.from_request(guide)))


def allowed(matcher):
    bitmask = allocate_token_bitmask(1, PADDED)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return set(unpack_bitmask(bitmask, PADDED)[0].nonzero().flatten().tolist())


def accepts(name, tok, guide, ids):
    backend, matcher = _matcher(name, tok, guide)
    return all(matcher.accept_token(t) for t in ids) and (matcher.is_terminated()
                                                          or matcher.accept_token(backend.stop_token_ids[0]))


@pytest.fixture(scope="module")
def mistral(tokenizer):
    tok = family_tokenizer(tokenizer, "mistral", MISTRAL)
    assert "[TOOL_CALLS]" not in tok.all_special_tokens  # a control token, as Mistral's tokenizer has it
    return tok, choose_tool_format("auto", "MistralForCausalLM", tok).fmt


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_required_and_named_start_with_the_control_id_and_auto_triggers_on_it(backend, mistral):
    tok, fmt = mistral
    tid = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    assert fmt.controls == (("[TOOL_CALLS]", tid),)
    one, two = (tok.encode(fmt.render_calls(c), add_special_tokens=False) for c in ([W], [W, T]))
    assert one[0] == tid  # the tokenizer writes the marker as its id
    spelled = tok.encode("[", add_special_tokens=False) + tok.encode("TOOL_CALLS] [", add_special_tokens=False)
    for choice in ("required", NAMED):
        guide = tool_guide(plan_tools([WEATHER, TIME], choice, None, fmt), backend)
        assert allowed(_matcher(backend, tok, guide)[1]) == {tid}  # the first id is the control token, no text
    required = tool_guide(plan_tools([WEATHER, TIME], "required", None, fmt), backend)
    assert accepts(backend, tok, required, one) and accepts(backend, tok, required, two)
    assert not accepts(backend, tok, required, spelled + one[1:])
    auto = tool_guide(plan_tools([WEATHER, TIME], "auto", None, fmt), backend)
    text = tok.encode("See [1]. ", add_special_tokens=False)
    assert accepts(backend, tok, auto, text + two)  # text, then the control id starts the list
    assert tid in allowed(_matcher(backend, tok, auto)[1])
    _, matcher = _matcher(backend, tok, auto)
    assert all(matcher.accept_token(t) for t in text + [tid])
    assert tid not in allowed(matcher) and not accepts(backend, tok, auto, text + [tid] + text)


def test_calls_are_read_from_ids(mistral):
    """The decoded text omits the control token; the ids keep it; a marker spelled as text is text."""
    tok, fmt = mistral
    plan = plan_tools([WEATHER, TIME], "auto", None, fmt)
    ids = tok.encode("See [1]. " + fmt.render_calls([W, T]), add_special_tokens=False)
    assert "[TOOL_CALLS]" not in tok.decode(ids, skip_special_tokens=True)
    text = marker_text(tok, ids, fmt.controls)
    assert parse_tool_output(text, plan) == ("See [1].", [W, T])
    stream, content, args = ToolCallStream(plan), "", {}
    for k in range(1, len(ids) + 1):  # token by token, as the server streams
        for ev in stream.feed(marker_text(tok, ids[:k], fmt.controls, k == len(ids)), final=k == len(ids)):
            delta = ev.delta()
            content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                args[call["index"]] = args.get(call["index"], "") + call["function"]["arguments"]
    assert content.strip() == "See [1]." and list(args.values()) == [W[1], T[1]]
    assert tool_call_error(text, plan_tools([WEATHER, TIME], "required", None, fmt)) is None
    spelled = "[" + fmt.render_calls([W])[1:]  # the marker written as text pieces: not a call
    spelled_ids = tok.encode("[", add_special_tokens=False) + tok.encode(spelled[1:], add_special_tokens=False)
    assert tid_free(spelled_ids, fmt) and parse_tool_output(marker_text(tok, spelled_ids, fmt.controls), plan)[1] == []
    cut = ids[:-3]  # max_tokens inside the second call: the first is a call, nothing is content but the text
    assert parse_tool_output(marker_text(tok, cut, fmt.controls), plan, cut=True) == ("See [1].", [W])


def tid_free(ids, fmt):
    return not set(ids) & {tid for _, tid in fmt.controls}


def test_hermes_tags_that_are_special_tokens_are_forced_and_read_as_ids(tokenizer):
    """A tokenizer whose ``<tool_call>`` tags are control tokens (not Qwen's): ids both ways."""
    tok = copy.deepcopy(tokenizer)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t, _ in FAMILY_TOKENS["hermes"]])
    tok.chat_template = QWEN
    fmt = choose_tool_format("hermes", "Qwen2ForCausalLM", tok).fmt
    open_id, close_id = (tok.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>"))
    assert dict(fmt.controls) == {"<tool_call>": open_id, "</tool_call>": close_id}
    plan = plan_tools([WEATHER, TIME], "required", None, fmt)
    ids = tok.encode(fmt.render_calls([W, T]), add_special_tokens=False)
    assert ids[0] == open_id and ids.count(close_id) == 2
    guide = tool_guide(plan, "xgrammar")
    assert allowed(_matcher("xgrammar", tok, guide)[1]) == {open_id} and accepts("xgrammar", tok, guide, ids)
    assert parse_tool_output(marker_text(tok, ids, fmt.controls), plan) == (None, [W, T])
