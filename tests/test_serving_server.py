"""The real server at tp 1 (``python launch/serve.py``) on the embedded model, driven by the ``openai`` client.

One server for the whole module (startup is the slow part); the last test
stops it with SIGTERM and checks its exit status.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import httpx
import jsonschema
import pytest
from server_process import ServerProcess, run_generate

from tpguide.serving.protocol import parse_request

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

KEY = "sk-test"
MODEL = "smol"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a time zone",
    "parameters": {"type": "object", "properties": {"utc_offset": {"type": "integer", "minimum": -12,
                                                                   "maximum": 14}},
                   "required": ["utc_offset"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
SERVER_ARGS = ["--api-key", KEY, "--served-model-name", MODEL, "--max-num-seqs", "4",
               "--max-waiting-requests", "2", "--max-body-bytes", "65536", "--max-new-tokens", "24",
               "--max-model-len", "1024"]


def user(text):
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(1, SERVER_ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=600)


def metric(server, name):
    text = httpx.get(server.base_url + "/metrics").text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else None


def test_health_and_models(server, client):
    assert httpx.get(server.base_url + "/health").json()["status"] == "ok"
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_json_schema_validates(client):
    r = client.chat.completions.create(
        model=MODEL, messages=user("Invent a person; JSON with name and age."), temperature=0, max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                                "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0


def test_json_object_and_extra_body_guides(client):
    r = client.chat.completions.create(model=MODEL, messages=user('Give {"city": ...} for the capital of France in JSON.'),
                                       temperature=0, max_tokens=40, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    cases = [({"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}}, r"\d{4}-\d{2}-\d{2}"),
             ({"structured_outputs": {"choice": ["yes", "no"]}}, r"yes|no"),
             ({"guided_choice": ["red", "blue"]}, r"red|blue"),
             ({"structured_outputs": {"grammar": 'root ::= [1-9] " + " [1-9] " = " [0-9]+'}},
              r"[1-9] \+ [1-9] = [0-9]+")]
    for extra, pattern in cases:
        r = client.chat.completions.create(model=MODEL, messages=user("Answer briefly."), temperature=0,
                                           max_tokens=16, extra_body=extra)
        assert r.choices[0].finish_reason == "stop", extra
        assert re.fullmatch(pattern, r.choices[0].message.content), (extra, r.choices[0].message.content)


def check_calls(calls, names):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_named_and_required_tool_choice(client):
    msgs = user("What is the weather in Paris?")
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], temperature=0,
                                       max_tokens=48,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message.tool_calls, {"get_time"})
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, TIME], temperature=0,
                                       max_tokens=64, tool_choice="required", parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message.tool_calls, {"get_weather", "get_time"})
    assert len(r.choices[0].message.tool_calls) == 1


def test_auto_tool_choice_gives_text_or_valid_calls(client):
    r = client.chat.completions.create(model=MODEL, messages=user("Weather in Rome? Use a tool."),
                                       tools=[WEATHER], temperature=0, max_tokens=64)
    msg = r.choices[0].message
    if msg.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        check_calls(msg.tool_calls, {"get_weather"})
    else:
        assert msg.content


def collect_stream(stream):
    text, reasons, usage, calls = "", [], None, {}
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            delta = getattr(c, "delta", None)
            text += (delta.content or "") if delta is not None else (c.text or "")
            for tc in (delta.tool_calls or []) if delta is not None else []:
                entry = calls.setdefault(tc.index, {"name": None, "arguments": ""})
                if tc.function.name:
                    entry["name"] = tc.function.name
                entry["arguments"] += tc.function.arguments or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return text, reasons, usage, calls


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 11}])
def test_stream_deltas_concatenate_to_the_answer(client, sampling):
    kw = dict(model=MODEL, messages=user("Write one sentence about the sea."), max_tokens=24, **sampling)
    full = client.chat.completions.create(**kw)
    text, reasons, usage, _ = collect_stream(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert text == full.choices[0].message.content and reasons == [full.choices[0].finish_reason]
    assert usage.completion_tokens == full.usage.completion_tokens
    ckw = dict(model=MODEL, prompt="The sea is", max_tokens=16, **sampling)
    full = client.completions.create(**ckw)
    text, reasons, _, _ = collect_stream(client.completions.create(**ckw, stream=True))
    assert text == full.choices[0].text and reasons == [full.choices[0].finish_reason]


def test_streamed_tool_arguments(client):
    kw = dict(model=MODEL, messages=user("Weather in Oslo?"), tools=[WEATHER, TIME], temperature=0,
              max_tokens=64, tool_choice="required", parallel_tool_calls=False)
    full = client.chat.completions.create(**kw).choices[0].message.tool_calls
    _, reasons, _, calls = collect_stream(client.chat.completions.create(**kw, stream=True))
    assert reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in full]


def test_a_call_cut_by_max_tokens_leaves_no_syntax_in_content(client):
    """The embedded model starts a second call in ``required`` (parallel allowed); max_tokens cuts it.

    The first prompt whose answer makes two calls (which one does depends on the CPU class's bf16 bits).
    """
    for question in ("Weather in Oslo and in Paris?", "Weather in Rome?", "Weather and time in Oslo?"):
        kw = dict(model=MODEL, messages=user(question), tools=[WEATHER, TIME], temperature=0,
                  tool_choice="required")
        if len(client.chat.completions.create(**kw, max_tokens=96).choices[0].message.tool_calls or []) >= 2:
            break
    else:
        raise AssertionError("no prompt made the embedded model start a second call")
    one = client.chat.completions.create(**kw, max_tokens=64, parallel_tool_calls=False)
    cut_at = one.usage.completion_tokens + 4  # the first call, then 4 tokens into what follows it
    r = client.chat.completions.create(**kw, max_tokens=cut_at)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and msg.content is None, msg
    first = [(c.function.name, c.function.arguments) for c in one.choices[0].message.tool_calls]
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == first
    text, reasons, _, calls = collect_stream(client.chat.completions.create(**kw, max_tokens=cut_at, stream=True))
    assert (text, reasons) == ("", ["length"])
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())][:1] == first and len(calls) <= 2


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=user("Say hi."), temperature=0, max_tokens=8,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert abs(e.logprob - e.top_logprobs[0].logprob) < 1e-4  # greedy picks the top token
    r = client.completions.create(model=MODEL, prompt="One, two,", temperature=0, max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text


def test_n_choices_with_derived_seeds(client):
    kw = dict(model=MODEL, messages=user("Name a fruit."), temperature=1.0, seed=5, max_tokens=12)
    two = client.chat.completions.create(**kw, n=2)
    one = client.chat.completions.create(**kw)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content == one.choices[0].message.content
    assert two.usage.prompt_tokens == one.usage.prompt_tokens


def expect_error(status, fn, *match):
    with pytest.raises(openai.APIStatusError) as e:
        fn()
    assert e.value.status_code == status, e.value
    err = e.value.body if isinstance(e.value.body, dict) else {}
    msg = err.get("message", "") if "message" in err else err.get("error", {}).get("message", "")
    for m in match:
        assert m in msg, (m, msg)
    return msg


def test_bad_requests_get_400_with_the_offline_message(server, client):
    chat = client.chat.completions.create
    expect_error(400, lambda: chat(model=MODEL, messages=user("x"), temperature=-1),
                 "temperature must be 0 or a number in")
    expect_error(400, lambda: chat(model=MODEL, messages=user("x"), max_tokens=5000), "exceeds max_model_len=1024")
    expect_error(400, lambda: chat(model=MODEL, messages=user("x"), extra_body={"structured_outputs":
                                                                                {"regex": "(unclosed"}}),
                 "regex")
    expect_error(400, lambda: chat(model=MODEL, messages=user("x"), extra_body={"structured_outputs":
                                                                                {"grammar": "root ::= ("}}),
                 "grammar")
    expect_error(400, lambda: chat(model=MODEL, messages=user("x"), response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", "properties": 3}}}))
    expect_error(400, lambda: chat(model=MODEL, messages=user("x"), extra_body={"min_p": 0.1}),
                 "unsupported field 'min_p'")
    expect_error(404, lambda: chat(model="gpt-4", messages=user("x")), "gpt-4")
    bad_key = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    expect_error(401, lambda: bad_key.models.list())
    r = httpx.post(server.base_url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   content=json.dumps({"model": MODEL, "prompt": "x" * 70000}))
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
    r = httpx.post(server.base_url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_queue_full_gets_503_with_retry_after(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600,
                                     headers={"Authorization": f"Bearer {KEY}"}) as c:
            body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True}
            return await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(9)])

    answers = asyncio.run(run())
    codes = [r.status_code for r in answers]
    assert set(codes) <= {200, 503} and codes.count(200) >= 4 and 503 in codes, codes
    for r in answers:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"


def test_disconnect_mid_stream_aborts(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=600,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks >= 3:
                # still reading: the request runs (leaving the line loop closes the stream, which aborts it)
                deadline = time.monotonic() + 10  # the gauge is set by the engine-loop thread
                while metric(server, "tpguide:num_requests_running") != 1 and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert metric(server, "tpguide:num_requests_running") == 1
                break
        assert chunks == 3
    deadline = time.monotonic() + 60
    while metric(server, "tpguide:num_requests_running") != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(server, "tpguide:num_requests_running") == 0
    assert metric(server, 'tpguide:request_success_total{finished_reason="abort"}') >= 1


def test_metrics_exposition(server):
    # what the metrics below count, made here so that the test does not depend on the order of the others
    r = httpx.post(server.base_url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   content=b"{not json")
    assert r.status_code == 400
    guided = {"prompt": "yes or no:", "max_tokens": 4, "temperature": 0,
              "structured_outputs": {"choice": ["yes", "no"]}}
    post(server, "completion", guided)
    post(server, "completion", guided)  # the same guide again: a grammar cache hit
    text = httpx.get(server.base_url + "/metrics").text
    for name in ("tpguide:num_requests_waiting", "tpguide:prompt_tokens_total", "tpguide:generation_tokens_total",
                 "tpguide:time_to_first_token_seconds_bucket", "tpguide:inter_token_latency_seconds_bucket",
                 "tpguide:e2e_request_latency_seconds_bucket", "tpguide:grammar_compile_seconds_bucket",
                 "tpguide:grammar_cache_hits_total", 'tpguide:request_failure_total{error_kind="invalid_request"}',
                 "tpguide:spec_decode_num_forced_draft_tokens_total", "tpguide:spec_decode_num_forward_passes_total"):
        assert name in text, name
    assert metric(server, "tpguide:generation_tokens_total") > 0
    assert metric(server, "tpguide:grammar_cache_hits_total") >= 1
    assert metric(server, "tpguide:spec_decode_num_forward_passes_total") > 0  # grammar drafts are on by default


def post(server, endpoint, body):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    r = httpx.post(server.base_url + path, json={"model": MODEL, **body}, timeout=600,
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r.json()


def agreement_cases(server):
    """(endpoint, body) pairs: greedy, seeded, completion, guided, each penalty, logit_bias, a stop string."""
    sea = user("Write about the sea, the sea, and the sea again.")
    plain = {"messages": sea, "temperature": 0, "max_tokens": 16, "logprobs": True}
    first = post(server, "chat", {**plain, "return_token_ids": True})["choices"][0]["token_ids"][0]
    plain_text = post(server, "chat", plain)["choices"][0]["message"]["content"]
    return [("chat", plain),
            ("chat", {"messages": user("Name three colours."), "temperature": 0.8, "seed": 21, "max_tokens": 16}),
            ("completion", {"prompt": "The capital of Italy is", "temperature": 0, "max_tokens": 8}),
            ("chat", {"messages": user("A person as JSON."), "temperature": 0, "max_tokens": 48,
                      "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}}),
            ("chat", {**plain, "presence_penalty": 1.5}),
            ("chat", {**plain, "frequency_penalty": 1.5}),
            ("chat", {**plain, "repetition_penalty": 1.5}),
            ("chat", {**plain, "logit_bias": {str(first): -100}}),
            ("chat", {**plain, "stop": [plain_text.split()[2]]})]


def test_server_agrees_with_offline_generate(server):
    """Same token ids and text as ``launch/generate.py`` on the same request lines; each penalty bites."""
    cases = agreement_cases(server)
    answers = [post(server, ep, {**body, "return_token_ids": True})["choices"][0] for ep, body in cases]
    lines = [parse_request({"model": MODEL, **body}, ep, f"agree{k}").lines[0] for k, (ep, body) in enumerate(cases)]
    offline, _ = run_generate(1, lines, ["--max-num-seqs", "4", "--max-model-len", "1024", "--quiet"])
    for (ep, body), ans, off in zip(cases, answers, offline):
        text = ans["message"]["content"] if ep == "chat" else ans["text"]
        assert (ans["token_ids"], text) == (off["token_ids"], off["text"]), body
    plain = answers[0]
    for ans, (_, body) in zip(answers[4:8], cases[4:8]):  # the penalty changed the tokens or the distributions
        assert ans["token_ids"] != plain["token_ids"] or ans["logprobs"] != plain["logprobs"], body
    stop_ans, stop = answers[8], cases[8][1]["stop"][0]
    assert stop_ans["finish_reason"] == "stop" and stop not in stop_ans["message"]["content"]
    assert answers[0]["message"]["content"].startswith(stop_ans["message"]["content"] + stop)


def test_stop_string_streamed(client):
    kw = dict(model=MODEL, messages=user("Write about the sea, the sea, and the sea again."), temperature=0,
              max_tokens=16)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    stop = plain.split()[2]
    full = client.chat.completions.create(**kw, stop=[stop])
    text, reasons, _, _ = collect_stream(client.chat.completions.create(**kw, stop=stop, stream=True))
    assert text == full.choices[0].message.content == plain[:plain.find(stop)]
    assert reasons == ["stop"] == [full.choices[0].finish_reason]


def test_sigterm_stops_the_server_with_status_0(server, client):
    """With a request running: its client gets a 503 "shutting down" (not a 500), the server exits 0."""
    import threading

    answers = []

    def long_request():
        try:
            client.chat.completions.create(model=MODEL, messages=user("Tell a long story."), max_tokens=400,
                                           extra_body={"ignore_eos": True})
            answers.append("finished")
        except openai.APIStatusError as exc:
            answers.append((exc.status_code, exc.message))

    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 60
    while "tpguide:num_requests_running 1.0" not in httpx.get(server.base_url + "/metrics").text:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.1)
    assert server.stop(signal.SIGTERM, timeout_s=30) == 0, server.log_text()[-3000:]
    worker.join(30)
    assert answers and answers[0][0] == 503 and "shutting down" in answers[0][1], answers
    assert server.stop_timed_out is False and server.orphans_left is False
    assert "[rank 0] stopped (signal 15); exit 0" in server.log_text()
