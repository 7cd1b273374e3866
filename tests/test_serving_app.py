"""The FastAPI app in process over a real engine on a tiny random-weight model (fast; no subprocess).

Limits, errors, the answer and chunk formats, streaming == non-streamed,
heartbeats while idle.  The slow end-to-end tests on the embedded model are
``test_serving_server.py`` (tp 1) and ``multigpu/test_serve_tp2.py``.
"""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine
from tpguide.engine.request_io import request_from_dict
from tpguide.serving.app import create_app
from tpguide.serving.server import make_precompile, make_server_state
from tpguide.serving.tool_formats import ToolSetup, hermes

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONFIG = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128)


@pytest.fixture(scope="module")
def app_client(tiny_model_path):
    engine = build_engine(TPGroup(), tiny_model_path, CONFIG)
    state = make_server_state(engine, CONFIG, served_model_name="tiny", api_key=KEY, max_waiting_requests=1,
                              max_body_bytes=4096, default_max_tokens=6, heartbeat_s=0.2,
                              tool_format=ToolSetup(hermes()))
    state.loop.start()
    state.precompile = make_precompile(engine, state.metrics)
    try:
        with TestClient(create_app(state)) as client:
            yield client, state
    finally:
        state.loop.stop()
        assert state.loop.stopped.is_set() and state.loop.error is None


def chat(client, **body):
    return client.post("/v1/chat/completions", headers=AUTH,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body})


def test_limits_and_errors(app_client):
    client, _ = app_client
    r = client.post("/v1/chat/completions", json={"model": "tiny"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = client.post("/v1/completions", headers=AUTH, content=json.dumps({"model": "tiny", "prompt": "x" * 5000}))
    assert r.status_code == 413
    r = chat(client, model="other")
    assert r.status_code == 404 and "'other'" in r.json()["error"]["message"]
    r = client.post("/v1/completions", headers=AUTH, content=b"{")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = chat(client, frequency_penalty=5)
    offline = request_from_dict({"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 5}, 0, 6)
    assert offline.finish_reason == "error" and "frequency_penalty must be a number in [-2, 2]" in offline.error
    assert r.status_code == 400 and r.json()["error"]["message"] == offline.error
    r = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}, "required": ["a"]}}})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = chat(client, max_tokens=500)
    assert r.status_code == 400 and "exceeds max_model_len=128" in r.json()["error"]["message"]
    assert client.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny"


def test_answer_stream_and_n(app_client):
    client, _ = app_client
    full = chat(client, temperature=0, max_tokens=6).json()
    (choice,) = full["choices"]
    assert full["object"] == "chat.completion" and choice["finish_reason"] in ("length", "stop")
    assert full["usage"]["completion_tokens"] == 6 or choice["finish_reason"] == "stop"
    with client.stream("POST", "/v1/chat/completions", headers=AUTH,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                             "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and len(c["choices"]) <= 1 for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == choice["message"]["content"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    two = chat(client, temperature=1.0, seed=3, n=2, max_tokens=6, return_token_ids=True).json()
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["choices"][0]["token_ids"] != two["choices"][1]["token_ids"]


def test_guided_choice_and_metrics(app_client):
    client, state = app_client
    for _ in range(2):
        r = chat(client, temperature=0, max_tokens=8, guided_choice=["alpha", "beta"])
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("alpha", "beta")
    # the engine loop updates its gauges after the step that finished the request, which may be
    # after the response went out: wait (bounded) for them instead of racing the loop
    deadline = time.monotonic() + 10
    text = client.get("/metrics").text
    while "tpguide:num_requests_running 0.0" not in text and time.monotonic() < deadline:
        time.sleep(0.05)
        text = client.get("/metrics").text
    assert "tpguide:grammar_cache_hits_total 1.0" in text and "tpguide:num_requests_running 0.0" in text


def test_idle_heartbeats(app_client):
    client, state = app_client
    before = client.get("/health").json()["heartbeats"]
    time.sleep(0.7)
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["heartbeats"] > before


def test_a_bug_in_a_handler_is_a_json_500_and_the_server_goes_on(app_client, monkeypatch):
    import tpguide.serving.app as app_module

    _, state = app_client

    def boom(_body):
        raise RuntimeError("boom")

    with TestClient(create_app(state), raise_server_exceptions=False) as client:
        monkeypatch.setattr(app_module, "find_invalid_text", boom)
        r = chat(client)
        assert r.status_code == 500, r.text
        assert r.json()["error"] == {"message": "server error: RuntimeError: boom", "type": "server_error",
                                     "param": None, "code": "server_fault"}
        monkeypatch.undo()
        assert chat(client).status_code == 200 and client.get("/health").status_code == 200
