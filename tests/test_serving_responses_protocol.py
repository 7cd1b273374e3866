"""Responses API pieces without a server: items -> chat messages, the same request line as chat, the
tools-or-schema guide on both backends, the stream writer's events against the non-streamed items, the store."""

from __future__ import annotations

import json

import pytest
from test_serving_tools import CALL_W, FMT, TIME, WEATHER, accepts

from tpguide.serving.errors import APIError
from tpguide.serving.protocol import parse_request
from tpguide.serving.responses_api import ResponseStore
from tpguide.serving.responses_output import output_items
from tpguide.serving.responses_protocol import responses_to_chat
from tpguide.serving.responses_stream import ResponseEvents
from tpguide.serving.tool_calls import tool_call_error

ANSWER = {"type": "object", "properties": {"city": {"type": "string"}, "temp": {"type": "integer"}},
          "required": ["city", "temp"], "additionalProperties": False}
RESPONSES_WEATHER = {"type": "function", **WEATHER["function"], "strict": True}


def lines(body, endpoint="chat"):
    return [{k: v for k, v in line.items() if k != "id"} for line in parse_request(body, endpoint, "r").lines]


def test_items_become_the_chat_messages():
    items = [{"role": "developer", "content": "Use tools."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                             {"type": "input_text", "text": "Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "18 C"}]
    chat = responses_to_chat({"model": "m", "input": items, "instructions": "Be brief.", "max_output_tokens": 9,
                              "text": {"format": {"type": "json_object"}}}).chat_body
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]
    assert chat["max_tokens"] == 9 and chat["response_format"] == {"type": "json_object"}


def test_same_request_line_as_chat():
    common = {"model": "m", "temperature": 0.7, "top_p": 0.9, "seed": 3}
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER, "strict": True}}
    chat = {**common, "max_tokens": 12, "messages": [{"role": "system", "content": "S"},
                                                     {"role": "user", "content": "Q"}],
            "tools": [{"type": "function", "function": {k: v for k, v in RESPONSES_WEATHER.items() if k != "type"}}],
            "tool_choice": "required", "response_format": rf}
    responses = {**common, "max_output_tokens": 12, "instructions": "S", "input": "Q", "tools": [RESPONSES_WEATHER],
                 "tool_choice": "required", "text": {"format": {"type": "json_schema", "name": "a", "schema": ANSWER,
                                                                "strict": True}}}
    assert lines(responses_to_chat(responses).chat_body) == lines(chat)
    no_tools = responses_to_chat({"model": "m", "input": "Q", "tools": [], "tool_choice": "auto"}).chat_body
    assert "tools" not in no_tools and "tool_choice" not in no_tools
    named = responses_to_chat({**responses, "tool_choice": {"type": "function", "name": "get_weather"}}).chat_body
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("body, field", [
    ({"input": "x", "background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"input": "x", "instructions": 3}, "instructions"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "tool_choice": "required", "tools": []}, "tool_choice"),
])
def test_refusals_name_the_field(body, field):
    with pytest.raises(APIError) as info:
        parse_request(responses_to_chat({"model": "m", **body}).chat_body, "chat", "r")
    assert info.value.status == 400 and info.value.param == field


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_tools_or_schema_guide(backend, tokenizer):
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}], "tools": [WEATHER, TIME],
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}}
    parsed = parse_request(body, "chat", "r", backend)
    guide = parsed.lines[0]["structured_output"]
    assert accepts(backend, guide, CALL_W, tokenizer)
    assert accepts(backend, guide, '{"city": "Paris", "temp": 18}', tokenizer)
    assert not accepts(backend, guide, 'It is warm. {"city": "Paris", "temp": 18}', tokenizer)
    assert not accepts(backend, guide, '{"city": "Paris"}', tokenizer)
    assert not accepts(backend, guide, FMT.render_call("get_weather", '{"city": 3}'), tokenizer)
    plan = parsed.tools
    assert plan.answer_schema == ANSWER and tool_call_error('{"city": "P", "temp": 1}', plan) is None
    assert "fails its response_format schema" in tool_call_error('{"city": "P"}', plan)
    assert tool_call_error(CALL_W, plan) is None
    required = parse_request({**body, "tool_choice": "required"}, "chat", "r", backend)
    assert required.tools.answer_schema is None
    assert required.lines[0]["structured_output"] == parse_request(
        {k: v for k, v in {**body, "tool_choice": "required"}.items() if k != "response_format"}, "chat", "r",
        backend).lines[0]["structured_output"]
    with pytest.raises(APIError, match="only one structured-output constraint"):
        parse_request({**body, "guided_regex": "a"}, "chat", "r", backend)


def chat_chunk(delta, finish_reason=None):
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}


class _Out:
    def __init__(self, ids, prompt):
        self.token_ids, self.num_prompt_tokens, self.reasoning = ids, prompt, "hm"


def _events(texts):
    return [json.loads(t.split("data: ", 1)[1]) for t in texts]


def test_stream_events_rebuild_the_items():
    message = {"role": "assistant", "content": "Sure.", "reasoning": "think",
               "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                              {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}
    whole = output_items(message, "tool_calls")
    w = ResponseEvents("resp_1", {"model": "m"}, 0, end_token_id=7)
    texts = w.start() + w.chunk(chat_chunk({"role": "assistant", "content": ""}))
    for delta in ({"reasoning": "thi"}, {"reasoning": "nk"}, {"content": "Sure"}, {"content": "."},
                  {"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f",
                                                                                             "arguments": ""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
                  {"tool_calls": [{"index": 1, "id": "c2", "type": "function", "function": {"name": "g",
                                                                                             "arguments": "{}"}}]}):
        texts += w.chunk(chat_chunk(delta))
    texts += w.chunk(chat_chunk({}, "tool_calls")) + w.done([_Out([1, 2, 7, 4, 5], 3)])
    events = _events(texts)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]
    assert final["type"] == "response.completed" and final["response"]["status"] == "completed"
    strip = [{k: v for k, v in item.items() if k != "id"} for item in final["response"]["output"]]
    assert strip == [{k: v for k, v in item.items() if k != "id"} for item in whole]
    assert final["response"]["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
    kinds = [e["type"] for e in events]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 4
    assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") == '{"a": 1}{}'


def test_cut_output_is_incomplete_and_errors_fail():
    w = ResponseEvents("resp_2", {"model": "m"}, 0)
    texts = w.start() + w.chunk(chat_chunk({"content": "ab"}, "length")) + w.done([_Out([1, 2], 1)])
    final = _events(texts)[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"
    assert output_items({"content": "ab"}, "length")[0]["status"] == "incomplete"
    bad = ResponseEvents("resp_3", {"model": "m"}, 0)
    kinds = [e["type"] for e in _events(bad.start() + bad.chunk(chat_chunk({}, "error")) + bad.done([]))]
    assert kinds[-2:] == ["error", "response.failed"]


def test_store_is_bounded_and_names_the_field():
    store = ResponseStore(capacity=2)
    for k in range(3):
        store.put({"id": f"r{k}", "output": [{"type": "message", "role": "assistant", "content": f"a{k}"}]},
                  [{"role": "user", "content": f"q{k}"}])
    assert len(store) == 2 and store.get("r0") is None
    assert [i["content"] for i in store.conversation("r2")] == ["q2", "a2"]
    with pytest.raises(APIError) as info:
        store.conversation("r0")
    assert info.value.param == "previous_response_id" and "last 2" in info.value.message
    chat = responses_to_chat({"model": "m", "input": "next"}, store.conversation("r1")).chat_body
    assert [m["content"] for m in chat["messages"]] == ["q1", "a1", "next"]
