"""The real server at tp 2 (``torchrun --nproc-per-node 2 launch/serve.py``, gloo) on the embedded model.

One server for the module: guided answers, streaming, tools, the same
tokens as ``launch/generate.py`` unsharded (tp 1), an idle wait longer than
the collective timeout (a short one, so that the wait is short too), and
SIGTERM ending every rank with status 0.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import jsonschema
import pytest
from server_process import ServerProcess, run_generate

from tpguide.serving.protocol import parse_request

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

MODEL = "smol"
#: short, so the idle test waits little; the longest legitimate wait in a collective here is rank 0 loading the
#: tokenizer and building its guide backend at startup (the model is converted before the server starts)
COLLECTIVE_TIMEOUT_S = 15
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                                   "maxLength": 30}},
                                          "required": ["city"], "additionalProperties": False}}}
FLAGS = ["--max-num-seqs", "4", "--max-model-len", "1024"]


def user(text):
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def server(default_model_path):
    with ServerProcess(2, ["--served-model-name", MODEL, "--collective-timeout", str(COLLECTIVE_TIMEOUT_S),
                           "--heartbeat-interval", "1", "--max-new-tokens", "24", *FLAGS]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=600)


def test_guided_streamed_and_tools(client):
    r = client.chat.completions.create(
        model=MODEL, messages=user("A person as JSON."), temperature=0, max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    kw = dict(model=MODEL, messages=user("One sentence about rivers."), temperature=0.7, seed=4, max_tokens=20)
    full = client.chat.completions.create(**kw).choices[0].message.content
    text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(**kw, stream=True)
                   if ch.choices)
    assert text == full
    r = client.chat.completions.create(model=MODEL, messages=user("Weather in Lima?"), tools=[TOOL],
                                       tool_choice="required", parallel_tool_calls=False, temperature=0,
                                       max_tokens=48)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])


def test_responses_api_at_tp2(client):
    text = {"format": {"type": "json_schema", "name": "p", "schema": SCHEMA, "strict": True}}
    r = client.responses.create(model=MODEL, input="A person as JSON.", temperature=0, max_output_tokens=48, text=text)
    c = client.chat.completions.create(
        model=MODEL, messages=user("A person as JSON."), temperature=0, max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}})
    assert r.status == "completed" and r.output_text == c.choices[0].message.content
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    events = list(client.responses.create(model=MODEL, input="A person as JSON.", temperature=0,
                                          max_output_tokens=48, text=text, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].type == "response.completed"


def test_server_at_tp2_agrees_with_offline_generate_at_tp1(server):
    plain = {"messages": user("Write about the sea, the sea, and the sea again."), "temperature": 0,
             "max_tokens": 16}
    cases = [("chat", plain), ("chat", {**plain, "temperature": 0.9, "seed": 8}),
             ("completion", {"prompt": "The capital of Italy is", "temperature": 0, "max_tokens": 8}),
             ("chat", {**plain, "frequency_penalty": 1.5, "repetition_penalty": 1.3, "logit_bias": {"30": -5}}),
             ("chat", {"messages": user("A person as JSON."), "temperature": 0, "max_tokens": 48,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}})]
    answers = []
    for ep, body in cases:
        path = "/v1/chat/completions" if ep == "chat" else "/v1/completions"
        r = httpx.post(server.base_url + path, json={"model": MODEL, **body, "return_token_ids": True}, timeout=600)
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0])
    lines = [parse_request({"model": MODEL, **body}, ep, f"a{k}").lines[0] for k, (ep, body) in enumerate(cases)]
    offline, _ = run_generate(1, lines, [*FLAGS, "--quiet"])  # sharded server == unsharded offline job
    for (_, body), ans, off in zip(cases, answers, offline):
        assert ans["token_ids"] == off["token_ids"], body
    assert answers[3]["token_ids"] != answers[0]["token_ids"]


def test_idle_longer_than_the_collective_timeout(server, client):
    before = httpx.get(server.base_url + "/health").json()["heartbeats"]
    time.sleep(COLLECTIVE_TIMEOUT_S + 2)
    health = httpx.get(server.base_url + "/health")
    assert health.status_code == 200 and health.json()["heartbeats"] > before
    r = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=4)
    assert r.usage.completion_tokens == 4


def test_sigterm_ends_every_rank_with_status_0(server):
    """SIGTERM to torchrun (as ``docker stop`` / systemd do): it forwards it to both ranks, which shut down.

    Each rank returns 0 (it says so last); torchrun itself then re-raises the
    signal it got, its own design, so its status is 1.  No process is left.
    """
    server.stop(signal.SIGTERM, timeout_s=60)
    log = server.log_text()
    assert "[rank 0] stopped (signal 15); exit 0" in log and "[rank 1] stopped; exit 0" in log, log[-3000:]
    assert "ChildFailedError" not in log and "no stop plan" not in log, log[-3000:]
    assert server.stop_timed_out is False and server.orphans_left is False
