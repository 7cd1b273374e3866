"""``/v1/responses``, ``/tokenize`` and ``/detokenize`` in process over a real engine on a tiny random model.

The ``openai`` client talks to the app through Starlette's test transport
(no subprocess): output items, the stream's events against the
non-streamed answer, the store, tools + a schema answer on both endpoints,
the same tokens as chat completions, 400s naming the field.  The end-to-end
tests on the embedded model through ``launch/serve.py`` are
``test_serving_responses.py``.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine
from tpguide.serving.app import create_app
from tpguide.serving.server import make_precompile, make_server_state
from tpguide.serving.tool_formats import ToolSetup, hermes

openai = pytest.importorskip("openai")

KEY = "k"
CONFIG = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256)
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
TOOL = {"type": "function", "name": "lookup", "description": "Look a word up", "strict": True,
        "parameters": {"type": "object", "properties": {"word": {"enum": ["cat", "dog"]}},
                       "required": ["word"], "additionalProperties": False}}
FORMAT = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def served(tiny_model_path):
    engine = build_engine(TPGroup(), tiny_model_path, CONFIG)
    state = make_server_state(engine, CONFIG, served_model_name="tiny", api_key=KEY, max_waiting_requests=2,
                              max_body_bytes=65536, default_max_tokens=8, heartbeat_s=0.2,
                              tool_format=ToolSetup(hermes(), json_whitespace="compact"))
    state.loop.start()
    state.precompile = make_precompile(engine, state.metrics)
    try:
        with TestClient(create_app(state)) as http:
            yield openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0), http
    finally:
        state.loop.stop()
        assert state.loop.error is None


def test_schema_answer_stream_and_store(served):
    client, _ = served
    r = client.responses.create(model="tiny", input="Give a JSON answer.", instructions="Be brief.",
                                max_output_tokens=40, temperature=0, text=FORMAT)
    assert r.status == "completed" and r.incomplete_details is None and r.object == "response"
    assert [i.type for i in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    events = list(client.responses.create(model="tiny", input="Give a JSON answer.", instructions="Be brief.",
                                          max_output_tokens=40, temperature=0, text=FORMAT, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == r.output_text == final.output_text
    assert final.usage.output_tokens == r.usage.output_tokens
    # the store: previous_response_id continues the conversation; GET returns it; store: false keeps nothing
    nxt = client.responses.create(model="tiny", input="And again.", previous_response_id=r.id, max_output_tokens=4,
                                  temperature=0)
    assert nxt.previous_response_id == r.id and nxt.usage.input_tokens > r.usage.input_tokens
    assert client.responses.retrieve(r.id).output_text == r.output_text
    gone = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)


def test_length_is_incomplete_and_same_tokens_as_chat(served):
    client, http = served
    body = {"model": "tiny", "temperature": 0.8, "top_p": 0.9, "seed": 5, "max_output_tokens": 6}
    r = client.responses.create(input=[{"role": "user", "content": [{"type": "input_text", "text": "Count."}]}],
                                instructions="You count.", extra_body={"seed": 5},
                                **{k: v for k, v in body.items() if k != "seed"})
    c = client.chat.completions.create(model="tiny", temperature=0.8, top_p=0.9, seed=5, max_tokens=6,
                                       messages=[{"role": "system", "content": "You count."},
                                                 {"role": "user", "content": "Count."}])
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert c.choices[0].finish_reason == "length"
    assert r.output_text == c.choices[0].message.content and r.usage.output_tokens == c.usage.completion_tokens == 6
    assert r.usage.input_tokens == c.usage.prompt_tokens
    tok = http.post("/tokenize", json={"model": "tiny", "messages": [{"role": "system", "content": "You count."},
                                                                     {"role": "user", "content": "Count."}]}).json()
    assert tok["count"] == c.usage.prompt_tokens == len(tok["tokens"]) and tok["max_model_len"] == 256
    plain = http.post("/tokenize", json={"prompt": "Count to three.", "return_token_strs": True}).json()
    assert len(plain["token_strs"]) == plain["count"]
    back = http.post("/detokenize", json={"model": "tiny", "tokens": plain["tokens"]}).json()
    assert back == {"prompt": "Count to three."}


def test_function_call_then_its_output(served):
    client, _ = served
    r = client.responses.create(model="tiny", input="Look up 'cat'.", tools=[TOOL], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=64, temperature=0)
    calls = [i for i in r.output if i.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "lookup"
    jsonschema.validate(json.loads(calls[0].arguments), TOOL["parameters"])
    events = list(client.responses.create(model="tiny", input="Look up 'cat'.", tools=[TOOL], tool_choice="required",
                                          parallel_tool_calls=False, max_output_tokens=64, temperature=0,
                                          stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == done[0].arguments == calls[0].arguments
    second = client.responses.create(
        model="tiny", tools=[TOOL], max_output_tokens=8, temperature=0,
        input=[{"role": "user", "content": "Look up 'cat'."},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "lookup", "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "a small animal"}])
    assert second.status in ("completed", "incomplete") and second.usage.input_tokens > r.usage.input_tokens
    chained = client.responses.create(model="tiny", previous_response_id=r.id, tools=[TOOL], max_output_tokens=8,
                                      temperature=0, input=[{"type": "function_call_output",
                                                             "call_id": calls[0].call_id, "output": "a small animal"}])
    assert chained.usage.input_tokens == second.usage.input_tokens


def test_tools_and_schema_in_one_request_both_endpoints(served):
    client, _ = served
    finished = []
    for seed in range(3):
        r = client.responses.create(model="tiny", input="Answer or look up.", tools=[TOOL], text=FORMAT,
                                    max_output_tokens=64, extra_body={"seed": seed})
        calls = [i for i in r.output if i.type == "function_call"]
        if r.status == "completed":
            finished.append("calls" if calls else "answer")
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])
            if not calls:
                jsonschema.validate(json.loads(r.output_text), SCHEMA)
        c = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Answer or look up."}], max_tokens=64, seed=seed,
            tools=[{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}],
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
        choice = c.choices[0]
        assert choice.finish_reason in ("tool_calls", "stop", "length")
        if choice.finish_reason == "tool_calls":
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), TOOL["parameters"])
        elif choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        texts = [i.content[0].text for i in r.output if i.type == "message"]
        assert (choice.finish_reason, choice.message.content or None) == (
            {"completed": "tool_calls" if calls else "stop", "incomplete": "length"}[r.status], texts[0] or None
            if texts else None)
        assert [(c.name, c.arguments) for c in calls] == [(t.function.name, t.function.arguments)
                                                          for t in choice.message.tool_calls or []]
    assert finished, "no request finished within max_output_tokens"


@pytest.mark.parametrize("extra, field", [
    ({"input": []}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"truncation": "auto"}, "truncation"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"frobnicate": 1}, "frobnicate"),
])
def test_bad_requests_name_the_field(served, extra, field):
    client, _ = served
    body = {"model": "tiny", "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**{k: v for k, v in body.items() if k != "frobnicate"},
                                extra_body={"frobnicate": 1} if "frobnicate" in extra else None)
    assert info.value.body["param"] == field, info.value.body
