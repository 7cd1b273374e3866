"""The server with each family's tool-call format, driven by the ``openai`` client: streamed and not.

One tp-1 server per format (hermes on a Qwen2-family model, llama3_json on a
Llama, mistral on a Mistral; tiny random weights with family-style templates,
``--tool-call-parser auto``): ``tool_choice="required"`` and a named
function give ``tool_calls`` whose arguments validate, the streamed deltas
concatenate to the same calls, ``finish_reason`` is ``"tool_calls"``.  And a
parser that contradicts the template stops the server at startup.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from server_process import ServerProcess
from tool_format_testing import FAMILIES, TIME, WEATHER, write_family_model

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

ARGS = ["--max-num-seqs", "2", "--max-model-len", "1024", "--json-whitespace", "compact", "--max-new-tokens", "96"]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module", params=["hermes", "llama3_json", "mistral"])
def served(request, tmp_path_factory, default_model_path):
    arch, template, _ = FAMILIES[request.param]
    model = write_family_model(tmp_path_factory.mktemp(request.param), arch, template, default_model_path, seed=3)
    with ServerProcess(1, ["--model", model, "--served-model-name", "m", "--tool-call-parser", "auto", *ARGS]) as srv:
        yield request.param, openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0,
                                           timeout=600)


def streamed_calls(stream):
    calls, reasons = {}, []
    for ch in stream:
        for c in ch.choices:
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, ["", ""])
                entry[0] = tc.function.name or entry[0]
                entry[1] += tc.function.arguments or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return [tuple(calls[i]) for i in sorted(calls)], reasons


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_calls_streamed_and_not(served, choice):
    fmt_name, client = served
    kw = dict(model="m", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, TIME],
              tool_choice=choice, parallel_tool_calls=False, temperature=0)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls", (fmt_name, r.choices[0].message)
    (call,) = r.choices[0].message.tool_calls
    assert call.type == "function" and call.id and (len(call.id) == 9) == (fmt_name == "mistral")
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    calls, reasons = streamed_calls(client.chat.completions.create(**kw, stream=True))
    assert reasons == ["tool_calls"] and calls == [(call.function.name, call.function.arguments)]


def test_a_parser_that_contradicts_the_template_stops_the_server(tmp_path, default_model_path):
    arch, template, _ = FAMILIES["mistral"]
    model = write_family_model(tmp_path / "m", arch, template, default_model_path)
    with pytest.raises(RuntimeError, match="writes mistral calls; use --tool-call-parser mistral"):
        with ServerProcess(1, ["--model", model, "--tool-call-parser", "hermes", *ARGS]):
            pass
