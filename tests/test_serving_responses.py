"""``/v1/responses`` on the real server at tp 1 (``python launch/serve.py``, the embedded model), with the ``openai``
client: ``responses.create`` / ``responses.parse`` with a strict schema, the stream against the answer, a required
function call and its output, tools and a schema answer in one request, the same tokens as chat completions.

The breadth (items, events, store, 400s) is tested in process on a tiny model: ``test_serving_responses_app.py``.
The last test is a small ``benchmarks/soak_server.py`` run on this server.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import jsonschema
import pydantic
import pytest
from server_process import ServerProcess

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

MODEL = "smol"


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
FORMAT = {"format": {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server():
    args = ["--served-model-name", MODEL, "--max-num-seqs", "4", "--max-waiting-requests", "16",
            "--max-new-tokens", "48", "--max-model-len", "1024"]
    with ServerProcess(1, args) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=600)


def test_schema_parse_and_stream(client):
    r = client.responses.create(model=MODEL, input="Invent a person; JSON with name and age.", temperature=0,
                                max_output_tokens=48, text=FORMAT)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    parsed = client.responses.parse(model=MODEL, input="Invent a person; JSON with name and age.", temperature=0,
                                    max_output_tokens=48, text_format=Person)
    assert isinstance(parsed.output_parsed, Person)
    assert parsed.output_parsed == Person.model_validate_json(r.output_text)  # the same schema, the same tokens
    with client.responses.stream(model=MODEL, input="Invent a person; JSON with name and age.", temperature=0,
                                 max_output_tokens=48, text=FORMAT) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == r.output_text
    assert final.usage.output_tokens == r.usage.output_tokens


def test_same_tokens_as_chat_completions(client):
    kwargs = {"model": MODEL, "temperature": 1.0, "top_p": 0.95}
    r = client.responses.create(input="Name three colours.", instructions="Answer briefly.", max_output_tokens=20,
                                extra_body={"seed": 11}, **kwargs)
    c = client.chat.completions.create(messages=[{"role": "system", "content": "Answer briefly."},
                                                 {"role": "user", "content": "Name three colours."}],
                                       max_tokens=20, seed=11, **kwargs)
    assert r.output_text == c.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)


def test_required_function_call_then_its_output(client):
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice="required", parallel_tool_calls=False, temperature=0,
                                max_output_tokens=48)
    calls = [i for i in r.output if i.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    second = client.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER], temperature=0,
                                     max_output_tokens=24, input=[{"type": "function_call_output",
                                                                   "call_id": calls[0].call_id,
                                                                   "output": '{"temperature_c": 18}'}])
    assert second.status in ("completed", "incomplete") and second.output[-1].type in ("message", "function_call")


def test_tools_and_a_schema_answer_on_both_endpoints(client):
    question = "What is the weather in Paris? Answer as JSON with name and age, or call a tool."
    # one call at most: the embedded model starts a second call it cannot finish in 48 tokens (docs/tool-calls.md)
    r = client.responses.create(model=MODEL, input=question, tools=[WEATHER], text=FORMAT, temperature=0,
                                max_output_tokens=48, parallel_tool_calls=False)
    calls = [i for i in r.output if i.type == "function_call"]
    assert r.status == "completed"
    if calls:
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    else:
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
    c = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=48,
        parallel_tool_calls=False, tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    message = c.choices[0].message
    assert c.choices[0].finish_reason == ("tool_calls" if calls else "stop")
    assert [(t.function.name, t.function.arguments) for t in message.tool_calls or []] == \
        [(i.name, i.arguments) for i in calls]
    if not calls:
        assert message.content == r.output_text


def test_bad_request_names_the_field(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hi", text={"format": {"type": "json_schema", "name": "x"}})
    assert info.value.body["param"] == "text.format.schema"


def test_small_soak_leaves_nothing_behind(server):
    """30 requests, 10 at once: chat and Responses streams, clients leaving mid-stream, malformed bodies."""
    spec = importlib.util.spec_from_file_location(
        "soak_server", Path(__file__).resolve().parents[1] / "benchmarks" / "soak_server.py")
    soak = sys.modules.setdefault("soak_server", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(soak)
    tally = asyncio.run(soak.run_soak(server.base_url, MODEL, requests=30, concurrency=10, max_tokens=32,
                                      disconnect_frac=0.15, malformed_frac=0.15, seed=1))
    o = tally.outcomes
    assert not [k for k in o if k.startswith(("lost", "error:", "malformed_got"))], o
    assert sum(o.values()) - o["invalid_answer"] == 30 and o["invalid_answer"] == 0
    assert o["cancelled"] > 0 and o["malformed_400"] > 0 and o["completed_stop"] == tally.valid > 0
    idle = soak.wait_idle(server.base_url)
    assert idle == {"tpguide:num_requests_running": 0, "tpguide:kv_cache_blocks_used": 0}
