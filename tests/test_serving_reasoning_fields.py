"""The server's reasoning fields without a server: request lines, include_reasoning, message fields, stream deltas."""

import pytest

from tpguide.serving.errors import APIError
from tpguide.serving.protocol import parse_request
from tpguide.serving.reasoning_fields import ReasoningStream, with_reasoning


def _body(**extra):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def test_reasoning_fields_reach_the_request_line():
    parsed = parse_request(_body(thinking_token_budget=8, chat_template_kwargs={"enable_thinking": False}),
                           "chat", "r")
    assert parsed.include_reasoning
    assert parsed.lines[0]["thinking_token_budget"] == 8
    assert parsed.lines[0]["chat_template_kwargs"] == {"enable_thinking": False}
    assert not parse_request(_body(include_reasoning=False), "chat", "r").include_reasoning
    with pytest.raises(APIError, match="include_reasoning must be true or false, got 'no'"):
        parse_request(_body(include_reasoning="no"), "chat", "r")
    with pytest.raises(APIError, match="include_reasoning"):  # a chat field only
        parse_request({"model": "m", "prompt": "hi", "include_reasoning": True}, "completion", "r")


def test_message_fields_and_stream_deltas():
    message = {"role": "assistant", "content": "{}"}
    assert with_reasoning(message, "hmm", True) == {**message, "reasoning": "hmm", "reasoning_content": "hmm"}
    assert with_reasoning(message, "hmm", False) == message == with_reasoning(message, None, True)
    stream = ReasoningStream()
    assert stream.delta("ab\ufffd", final=False) == "ab"  # a character cut between tokens waits
    assert stream.delta("abé", final=False) == "é"
    assert stream.delta("abé", final=True) == ""


def test_tool_calls_come_from_the_answer_never_the_reasoning():
    from types import SimpleNamespace

    from tpguide.serving.responses import build_answer
    from tpguide.serving.tool_formats import hermes

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    call = hermes().render_calls([("get_weather", '{"city": "Paris"}')])  # the server's default format
    parsed = parse_request(_body(tools=[weather], tool_choice="auto"), "chat", "r")

    def answer(reasoning, text):
        out = SimpleNamespace(text=text, reasoning=reasoning, finish_reason="stop", token_ids=[1, 2],
                              num_prompt_tokens=3, logprobs=None, error=None)
        return build_answer(parsed, "r", [out], token_text=None)["choices"][0]

    thought = answer(f"maybe {call}", "It is sunny.")  # a call the model only thought about
    assert thought["finish_reason"] == "stop" and "tool_calls" not in thought["message"]
    assert thought["message"]["content"] == "It is sunny." and thought["message"]["reasoning"] == f"maybe {call}"
    made = answer("I should call it.", call)
    assert made["finish_reason"] == "tool_calls"
    assert made["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
