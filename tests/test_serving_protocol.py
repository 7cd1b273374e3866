"""OpenAI bodies -> request lines: mapping, refusals, messages, seeds (no model)."""

from __future__ import annotations

import pytest

from tpguide.engine.request_io import request_from_dict
from tpguide.serving.errors import APIError
from tpguide.serving.protocol import derived_seed, parse_request

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return parse_request({"model": "m", "messages": MSG, **kw}, "chat", "r")


def test_chat_defaults_follow_openai():
    p = chat()
    assert p.n == 1 and not p.stream and p.logprobs is None and p.tools is None
    (line,) = p.lines
    assert line == {"id": "r-0", "messages": MSG, "temperature": 1.0, "top_p": 1.0}


def test_sampling_fields_and_max_completion_tokens():
    (line,) = chat(temperature=0, top_p=0.5, top_k=3, seed=7, max_tokens=9, max_completion_tokens=5,
                   user="u", metadata={"a": "b"}).lines
    assert line["temperature"] == 0 and line["top_p"] == 0.5 and line["top_k"] == 3 and line["seed"] == 7
    assert line["max_tokens"] == 5  # max_completion_tokens wins, as OpenAI's newer name
    assert "user" not in line and "metadata" not in line


@pytest.mark.parametrize("field", ["best_of_x", "min_p", "functions", "audio", "prediction"])
def test_unknown_or_unsupported_field_is_refused_by_name(field):
    with pytest.raises(APIError) as e:
        chat(**{field: 1})
    assert e.value.status == 400 and field in e.value.message and e.value.param == field


def test_completion_refusals():
    for field, value in [("echo", True), ("suffix", "x"), ("best_of", 3)]:
        with pytest.raises(APIError) as e:
            parse_request({"model": "m", "prompt": "a", field: value}, "completion", "r")
        assert e.value.status == 400 and field in e.value.message
    with pytest.raises(APIError, match="token-id prompts"):
        parse_request({"model": "m", "prompt": [1, 2]}, "completion", "r")


def test_completion_prompt_list_and_n_are_prompt_major():
    p = parse_request({"model": "m", "prompt": ["a", "b"], "n": 2, "seed": 3}, "completion", "c")
    assert [line["prompt"] for line in p.lines] == ["a", "a", "b", "b"]
    assert [line["seed"] for line in p.lines] == [3, derived_seed(3, 1), 3, derived_seed(3, 1)]
    assert [line["id"] for line in p.lines] == ["c-0", "c-1", "c-2", "c-3"]


def test_n_without_seed_leaves_seeding_to_the_engine():
    assert all("seed" not in line for line in chat(n=3).lines)
    assert len({derived_seed(5, j) for j in range(1, 16)} | {5}) == 16


def test_response_formats():
    assert "structured_output" not in chat(response_format={"type": "text"}).lines[0]
    assert chat(response_format={"type": "json_object"}).lines[0]["structured_output"] == {"json_object": True}
    schema = {"type": "object"}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert chat(response_format=rf).lines[0]["structured_output"] == {"json": schema}
    best_effort = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": False}}
    assert chat(response_format=best_effort).lines[0]["structured_output"] == {"json": schema, "strict": False}
    with pytest.raises(APIError, match="strict must be true or false, got 'no'"):
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": "no"}})
    with pytest.raises(APIError, match="response_format.type"):
        chat(response_format={"type": "xml"})


def test_structured_outputs_and_legacy_fields():
    assert chat(structured_outputs={"regex": "a+"}).lines[0]["structured_output"] == {"regex": "a+"}
    assert chat(guided_choice=["x", "y"]).lines[0]["structured_output"] == {"choice": ["x", "y"]}
    assert chat(guided_grammar="root ::= \"a\"").lines[0]["structured_output"] == {"grammar": "root ::= \"a\""}
    with pytest.raises(APIError, match="only one structured-output constraint"):
        chat(guided_regex="a", response_format={"type": "json_object"})


def test_bad_structured_output_gets_the_offline_message():
    (line,) = chat(structured_outputs={"regexp": "a"}).lines
    req = request_from_dict(line, 0, 16)  # bad input: a request already failed with the message
    assert req.finish_reason == "error" and "unknown structured_output keys" in req.error


def test_logprobs_mapping():
    assert chat(logprobs=True, top_logprobs=3).lines[0]["logprobs"] == 3
    p = chat(logprobs=True)
    assert p.logprobs == 0 and p.lines[0]["logprobs"] == 1  # the token's own logprob needs 1
    with pytest.raises(APIError, match="top_logprobs needs logprobs=true"):
        chat(top_logprobs=2)
    assert parse_request({"model": "m", "prompt": "a", "logprobs": 2}, "completion", "r").logprobs == 2


def test_stop_and_neutral_penalties():
    assert chat(stop="x").lines[0]["stop"] == ["x"]
    line = chat(presence_penalty=0.0, frequency_penalty=0, repetition_penalty=1.0, logit_bias={}).lines[0]
    assert not {"presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"} & set(line)
    assert chat(presence_penalty=0.5).lines[0]["presence_penalty"] == 0.5


def test_stream_options():
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    with pytest.raises(APIError, match="only allowed with stream=true"):
        chat(stream_options={"include_usage": True})


def test_messages_rendering():
    msgs = [{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "nice"}]},
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "42"}]
    (line,) = chat(messages=msgs).lines
    out = line["messages"]
    assert out[0] == {"role": "system", "content": "be nice"}
    assert out[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert out[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
    assert not request_from_dict(line, 0, 8).is_finished  # the request line accepts what the server builds
    with pytest.raises(APIError, match="content part type 'image_url'"):
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(APIError, match="role must be one of"):
        chat(messages=[{"role": "robot", "content": "x"}])


def test_model_and_body_checks():
    with pytest.raises(APIError, match="'model' is required"):
        parse_request({"messages": MSG}, "chat", "r")
    with pytest.raises(APIError, match="JSON object"):
        parse_request([1], "chat", "r")
    with pytest.raises(APIError, match=r"n must be an int in \[1, 16\]"):
        chat(n=0)
