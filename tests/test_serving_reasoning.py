"""The server on the tiny reasoning model, driven by the ``openai`` client: message.reasoning, stream order, options."""

import json

import jsonschema
import pytest
from reasoning_testing import SCHEMA
from server_process import ServerProcess

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

MODEL = "tiny-reasoning"
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Is it ok? Answer in JSON."}]


@pytest.fixture(scope="module")
def client(reasoning_model_path):
    args = ["--model", reasoning_model_path, "--reasoning-parser", "qwen3", "--served-model-name", MODEL,
            "--max-num-seqs", "4", "--max-model-len", "256", "--json-whitespace", "compact"]
    with ServerProcess(1, args) as srv:
        yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=600)


def _ask(client, **extra):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=48,
                                          response_format=FORMAT, extra_body={"thinking_token_budget": 8, **extra})


def test_message_reasoning_and_a_valid_answer(client):
    choice = _ask(client).choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert isinstance(choice.message.reasoning, str) and choice.message.reasoning
    assert choice.message.reasoning_content == choice.message.reasoning
    assert "{" not in choice.message.reasoning or choice.message.content not in choice.message.reasoning


def test_stream_sends_reasoning_then_content(client):
    whole = _ask(client).choices[0].message
    kinds, reasoning, content = [], "", ""
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=48,
                                            response_format=FORMAT, stream=True,
                                            extra_body={"thinking_token_budget": 8})
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        if getattr(delta, "reasoning", None):
            kinds.append("reasoning")
            reasoning += delta.reasoning
            assert delta.reasoning_content == delta.reasoning
        if delta.content:
            kinds.append("content")
            content += delta.content
    assert kinds and kinds == sorted(kinds, key=lambda k: k == "content") and kinds[0] == "reasoning"
    assert (reasoning, content) == (whole.reasoning, whole.content)


def test_include_reasoning_false_and_enable_thinking_false(client):
    kept = _ask(client).choices[0].message
    left_out = _ask(client, include_reasoning=False).choices[0].message
    assert getattr(left_out, "reasoning", None) is None and left_out.content == kept.content
    direct = _ask(client, chat_template_kwargs={"enable_thinking": False}).choices[0]
    assert getattr(direct.message, "reasoning", None) is None and direct.finish_reason == "stop"
    jsonschema.validate(json.loads(direct.message.content), SCHEMA)


def test_responses_reasoning_item_before_the_message(client):
    text = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}
    r = client.responses.create(model=MODEL, input=MESSAGES[0]["content"], temperature=0, max_output_tokens=48,
                                text=text, extra_body={"thinking_token_budget": 8})
    chat = _ask(client).choices[0].message
    assert [i.type for i in r.output] == ["reasoning", "message"] and r.status == "completed"
    assert r.output[0].content[0].text == chat.reasoning and r.output_text == chat.content
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    events = list(client.responses.create(model=MODEL, input=MESSAGES[0]["content"], temperature=0,
                                          max_output_tokens=48, text=text, stream=True,
                                          extra_body={"thinking_token_budget": 8}))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, answer) == (chat.reasoning, chat.content)
    assert [e.item.type for e in events if e.type == "response.output_item.added"] == ["reasoning", "message"]
