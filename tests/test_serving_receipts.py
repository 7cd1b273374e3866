"""Receipts in server answers and ``POST /v1/guides/check`` (docs/receipts.md), in process on the tiny random model.

A receipt comes only when asked (``return_receipt``) or with ``--return-receipts``; streamed, it rides the
choice's last chunk and equals the non-streamed one; the guide check gives the message a generation request
gets in its 400.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine
from tpguide.engine.receipt import token_ids_hash
from tpguide.serving.app import create_app
from tpguide.serving.server import make_guide_check, make_precompile, make_server_state
from tpguide.serving.tool_formats import ToolSetup, hermes

CONFIG = EngineConfig(max_num_seqs=2, max_num_batched_tokens=256, max_model_len=256)
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def app_client(tiny_model_path):
    engine = build_engine(TPGroup(), tiny_model_path, CONFIG)
    state = make_server_state(engine, CONFIG, served_model_name="tiny", api_key=None, max_waiting_requests=2,
                              max_body_bytes=1 << 16, default_max_tokens=6, heartbeat_s=0.2,
                              tool_format=ToolSetup(hermes()))
    state.loop.start()
    state.precompile = make_precompile(engine, state.metrics)
    state.guide_check = make_guide_check(engine, CONFIG)
    try:
        with TestClient(create_app(state)) as client:
            yield client, state
    finally:
        state.loop.stop()


def chat(client, **body):
    return client.post("/v1/chat/completions",
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body})


def test_receipt_only_when_asked_and_the_same_streamed(app_client):
    client, state = app_client
    body = dict(temperature=0, max_tokens=12, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}, return_token_ids=True)
    assert "receipt" not in chat(client, **body).json()["choices"][0]
    assert chat(client, return_receipt="yes").status_code == 400
    (choice,) = chat(client, return_receipt=True, **body).json()["choices"]
    receipt = choice["receipt"]
    assert receipt["output"]["token_ids"] == token_ids_hash(choice["token_ids"])
    assert receipt["guide"]["kind"] == "json_schema" and receipt["sampling"]["temperature"] == 0
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True, "return_receipt": True,
            **body}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"]
    with_receipt = [c for c in chunks if c["choices"] and "receipt" in c["choices"][0]]
    assert [c is chunks[-1] for c in with_receipt] == [True] and chunks[-1]["choices"][0]["finish_reason"]
    streamed = with_receipt[0]["choices"][0]["receipt"]
    assert streamed["sampling"].pop("seed") != receipt["sampling"].pop("seed")  # derived from the request's index
    assert streamed == receipt
    state.return_receipts = True  # --return-receipts
    try:
        tool = chat(client, max_tokens=4, tools=TOOLS, tool_choice="required").json()["choices"][0]["receipt"]
    finally:
        state.return_receipts = False
    assert tool["guide"]["tools"] == {"format": "hermes", "tool_choice": "required", "functions": ["get_weather"],
                                      "parallel_tool_calls": True}


def test_guide_check_endpoint_agrees_with_generation(app_client):
    client, _ = app_client
    typo = {"type": "object", "propertieC": {"a": {"type": "integer"}}, "required": ["a"]}
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": typo}}
    refused = chat(client, response_format=rf)
    assert refused.status_code == 400
    r = client.post("/v1/guides/check", json={"guides": [{"response_format": rf},
                                                         {"response_format": {"type": "json_schema", "json_schema": {
                                                             "name": "ok", "schema": SCHEMA}}},
                                                         {"tools": TOOLS, "tool_choice": "required"},
                                                         {"response_format": {"type": "bogus"}}]})
    assert r.status_code == 200
    bad, good, tools, malformed = r.json()["data"]
    assert not bad["admitted"] and bad["error"] == refused.json()["error"]["message"]
    assert bad["reasons"][0]["pointer"] == "/required" and bad["reasons"][0]["keyword"] == "required"
    assert good["admitted"] and good["backend"] == "xgrammar" and good["guide_hash"].startswith("sha256:")
    assert tools["admitted"] and tools["tools"] == {"format": "hermes", "tool_choice": "required"}
    assert not malformed["admitted"] and "response_format.type" in malformed["error"]
    single = client.post("/v1/guides/check", json={"response_format": rf}).json()["data"]
    assert single[0]["error"] == bad["error"] and single[0]["reasons"] == bad["reasons"]
    assert client.post("/v1/guides/check", json={"guides": [{"messages": []}]}).status_code == 400
