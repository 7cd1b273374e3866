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
