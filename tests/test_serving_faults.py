"""Nothing a client sends stops the server (``python launch/serve.py`` at tp 1 on the tiny random model).

One server for the module, started with ``TPGUIDE_REQUEST_FAULT`` so that a
request can make the engine raise on purpose (tpguide/engine/request_faults.py):

* a lone surrogate in any field is a 400 naming the field, and the next request is served;
* ``required`` naming a property ``properties`` lacks is a 400 naming ``/required``, before any token;
* a request whose step raises fails alone with a 500 naming the exception, beside requests that finish;
* a bounded fuzz (a fixed seed, loopback only): no 5xx, every 4xx with OpenAI's error object, ``/health``
  200 after each request (tests/fuzz_bodies.py; a longer run: ``benchmarks/fuzz_server.py``);
* last, a fault of the step itself kills the engine loop: the server process exits non-zero within seconds.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import jsonschema
import pytest
from fuzz_bodies import SCHEMA, fuzz_bodies
from server_process import ServerProcess
from test_serving_server import metric

pytestmark = pytest.mark.slow

MODEL = "tiny"
KEY = "sk-fuzz"
FINISH_FAULT, LOOP_FAULT = "FAULT-IN-FINISH", "FAULT-KILLS-THE-LOOP"
HEADERS = {"Authorization": f"Bearer {KEY}"}
FUZZ_COUNT = 300


@pytest.fixture(scope="module")
def server(tiny_model_path):
    args = ["--model", tiny_model_path, "--served-model-name", MODEL, "--api-key", KEY, "--max-num-seqs", "4",
            "--max-waiting-requests", "64", "--max-new-tokens", "12", "--max-model-len", "512",
            "--max-body-bytes", str(1 << 20)]
    env = {"TPGUIDE_REQUEST_FAULT": f"finish:{FINISH_FAULT},step:{LOOP_FAULT}"}
    with ServerProcess(1, args, env=env) as srv:
        yield srv


def post(server, endpoint, body, **kw):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.base_url + path, content=content, headers={**HEADERS, "Content-Type": "application/json"},
                      timeout=120, **kw)


def chat(text, **extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0,
            **extra}


def assert_error(response, status, *needles):
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["type"], error
    for needle in needles:
        assert needle in error["message"], error["message"]
    return error


def test_a_lone_surrogate_is_a_400_naming_the_field_and_the_next_request_is_served(server):
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 4}'
    error = assert_error(post(server, "chat", raw), 400,
                         "messages[0].content is not valid Unicode (lone surrogate U+D800 at character 0)")
    assert error["param"] == "messages[0].content"
    assert_error(post(server, "completion", b'{"model": "tiny", "prompt": "hi", "stop": ["\\udc00"]}'), 400,
                 "stop[0] is not valid Unicode")
    assert_error(post(server, "chat", chat("hi", tools=[{"type": "function", "function": {"name": "f\udbff"}}])),
                 400, "tools[0].function.name is not valid Unicode")
    assert_error(post(server, "chat", chat("hi", logit_bias={"\udfff": 1})), 400, "a key of logit_bias")
    ok = post(server, "chat", chat("Hello"))
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_required_without_properties_is_refused_before_any_token(server):
    before = metric(server, "tpguide:generation_tokens_total")
    assert before is not None
    typo = {"type": "object", "propertieC": {"name": {"type": "string"}}, "required": ["name"]}
    body = chat("A person.", response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": typo}})
    assert_error(post(server, "chat", body), 400, "'required' names ['name']", "(at /required)")
    assert metric(server, "tpguide:generation_tokens_total") == before


def test_a_request_that_makes_the_engine_raise_fails_alone(server):
    bodies = {"faulty": chat(f"Say {FINISH_FAULT}"),
              "json": chat("A person.", max_tokens=48,
                           response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}),
              "free": chat("Hello there", max_tokens=6)}
    answers = {}

    def send(name):
        answers[name] = post(server, "chat", bodies[name])

    threads = [threading.Thread(target=send, args=(name,)) for name in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    error = assert_error(answers["faulty"], 500, "server error while finishing a step of the request",
                         "InjectedFault")
    assert error["type"] == "server_error" and error["code"] == "server_fault"
    assert answers["free"].status_code == 200
    assert answers["json"].status_code == 200, answers["json"].text
    choice = answers["json"].json()["choices"][0]
    if choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_fuzzed_bodies_get_no_5xx_and_the_server_stays_healthy(server):
    statuses = {}
    for i, (endpoint, raw, stream) in enumerate(fuzz_bodies(FUZZ_COUNT, MODEL, seed=44)):
        r = post(server, endpoint, raw)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        where = f"body {i} ({endpoint}): {raw[:300]!r}"
        assert r.status_code < 500, f"{where} -> {r.status_code} {r.text[:500]}"
        if r.status_code >= 400:
            error = r.json().get("error")
            assert isinstance(error, dict) and error.get("message") and error.get("type"), f"{where}: {r.text}"
        elif stream:
            assert '"server_error"' not in r.text, f"{where}: {r.text[-800:]}"
        health = httpx.get(server.base_url + "/health")
        assert health.status_code == 200, f"after {where}: {health.text}"
    assert statuses.get(200, 0) >= FUZZ_COUNT // 20 and sum(v for k, v in statuses.items() if k >= 400), statuses


def test_a_dead_engine_loop_ends_the_server_with_a_nonzero_status(server):
    r = post(server, "chat", chat(f"Now {LOOP_FAULT}"))
    assert_error(r, 503, "engine loop failed", "InjectedFault")
    deadline = time.monotonic() + 20
    while server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.proc.poll() not in (None, 0), server.log_text()[-3000:]
    assert "the engine loop died" in server.log_text()
