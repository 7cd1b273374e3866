"""The grammar cache key holds every field that changes admission or compilation (issue 23; tp 1, tiny random model).

The key (``GuidedBackend.cache_key``, docs/architecture.md §5) is
(backend, guide type, guide text, ``strict``, whitespace mode).  Without
``strict`` in it, a ``strict: false`` admission under ``auto`` admitted the
strict request for the same schema that should be refused with the
keyword's pointer.  Checked in the engine (offline) and through the server,
under ``auto``, ``xgrammar`` and ``llguidance``, in both orders; and two
requests that differ only in their whitespace mode compile two grammars.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from guided_testing import load_test_backend
from server_process import ServerProcess

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, generate_on_group
from tpguide.guided.params import MAX_BOUNDED_WHITESPACE, StructuredOutputsParams

BACKENDS = ("auto", "xgrammar", "llguidance")
ORDERS = ("best-first", "strict-first")
#: A oneOf whose branches overlap (every integer is a number): neither backend enforces it, both compile it.
ONE_OF = {"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "number"}]}},
          "required": ["v"], "additionalProperties": False}
ONE_OF_POINTER = "/properties/v/oneOf"
#: The issue's example: xgrammar ignores uniqueItems (llguidance does not compile it).
UNIQUE = {"type": "array", "items": {"type": "integer"}, "maxItems": 3, "uniqueItems": True}
UNIQUE_POINTER = "/uniqueItems"
#: Cases (schema, its unenforced keyword, the keyword's pointer, the backends that run it best effort).
CASES = {"oneOf": (ONE_OF, "oneOf", ONE_OF_POINTER, BACKENDS),
         "uniqueItems": (UNIQUE, "uniqueItems", UNIQUE_POINTER, ("auto", "xgrammar"))}
#: ``(case name, backend)`` pairs where the backend runs the case best effort.
RUNNABLE = [(name, backend) for name, case in CASES.items() for backend in case[3]]
#: What ``auto`` runs a best-effort request on, and the backends a strict refusal names.
RUNS_ON = {"auto": "xgrammar", "xgrammar": "xgrammar", "llguidance": "llguidance"}
REFUSERS = {"auto": ("xgrammar", "llguidance"), "xgrammar": ("xgrammar",), "llguidance": ("llguidance",)}
BOOL_SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
               "additionalProperties": False}
CONFIG = dict(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=96)
MODEL = "tiny"


def schema_for(schema, order):
    """``schema`` with a description naming ``order``: each order starts from an empty cache entry."""
    return {"description": order, **schema}


def pair(order):
    """``[strict, ...]`` of the two requests of ``order``, in submission order."""
    return [False, True] if order == "best-first" else [True, False]


def assert_refused_with_pointer(error, backend, keyword, pointer):
    for refuser in REFUSERS[backend]:
        if refuser == "llguidance" and keyword == "uniqueItems":
            assert "llguidance cannot compile" in error, error
        else:
            assert f"{keyword!r} is not enforced by {refuser} (at {pointer})" in error, error


def test_strict_is_part_of_the_key_and_the_whitespace_mode_is_resolved(tokenizer):  # tokenizer: skips without it
    backend = load_test_backend("xgrammar", 49152)
    strict, best = StructuredOutputsParams(json=ONE_OF), StructuredOutputsParams(json=ONE_OF, strict=False)
    assert strict != best and backend.cache_key(strict) != backend.cache_key(best)
    assert backend.cache_key(best) == ("xgrammar", "json_schema", json.dumps(ONE_OF), ("strict", False),
                                       ("json_whitespace", backend.json_whitespace))
    named = StructuredOutputsParams(json=ONE_OF, json_whitespace=backend.json_whitespace)
    assert backend.cache_key(named) == backend.cache_key(strict)  # unset = the backend's default: one entry
    compact = StructuredOutputsParams(json=ONE_OF, json_whitespace="compact")
    assert backend.cache_key(compact) != backend.cache_key(strict)
    assert backend.cache_key(StructuredOutputsParams(regex="a+"))[-1] == ("json_whitespace", None)


# ------------------------------------------------------------------ the engine, offline

def _engine_requests(backend):
    out = []
    for name in [n for n, b in RUNNABLE if b == backend]:
        schema = CASES[name][0]
        for order in ORDERS:
            for strict in pair(order):
                out.append({"id": f"{name}:{order}:{'strict' if strict else 'best'}", "prompt": "JSON:",
                            "max_tokens": 8, "temperature": 0.0,
                            "structured_output": {"json": schema_for(schema, order), "strict": strict}})
    return out


@pytest.fixture(scope="module")
def offline(tiny_model_path):
    """``{backend: {request id: output line}}``: each backend's requests in one run, admitted in order."""
    return {backend: {o["id"]: o for o in generate_on_group(
        TPGroup(), tiny_model_path, _engine_requests(backend), EngineConfig(guided_backend=backend, **CONFIG), 8)}
        for backend in BACKENDS}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name, backend", RUNNABLE)
def test_offline_strict_request_is_refused_whatever_ran_best_effort(offline, name, backend, order):
    _, keyword, pointer, _ = CASES[name]
    strict, best = offline[backend][f"{name}:{order}:strict"], offline[backend][f"{name}:{order}:best"]
    assert strict["finish_reason"] == "error" and strict["token_ids"] == [], strict
    assert_refused_with_pointer(strict["error"], backend, keyword, pointer)
    assert best["guided_backend"] == RUNS_ON[backend] and best["token_ids"], best
    assert best["finish_reason"] in ("stop", "length", "error"), best
    if best["finish_reason"] == "error":
        assert best["error"].startswith("output"), best  # validated at the end, not refused


# ------------------------------------------------------------------ through the server

@pytest.fixture(scope="module", params=BACKENDS)
def served(request, tiny_model_path):
    """``(backend, server, client)``: a tp-1 server of the tiny model per backend."""
    openai = pytest.importorskip("openai")
    args = ["--model", tiny_model_path, "--served-model-name", MODEL, "--guided-backend", request.param,
            "--max-num-seqs", "4", "--max-new-tokens", "8", "--max-model-len", "256"]
    with ServerProcess(1, args) as srv:
        yield request.param, srv, openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0,
                                                timeout=600)


def _chat(client, schema, strict):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON:"}], temperature=0, max_tokens=8,
        extra_body={"structured_outputs": {"json": schema, "strict": strict}})


@pytest.mark.parametrize("order", ORDERS)
def test_served_strict_request_is_a_400_with_the_pointer_whatever_ran_best_effort(served, order):
    import openai

    backend, _, client = served
    for name in [n for n, b in RUNNABLE if b == backend]:
        schema, keyword, pointer, _ = CASES[name]
        schema = schema_for(schema, order)
        for strict in pair(order):
            if strict:
                with pytest.raises(openai.BadRequestError) as refused:
                    _chat(client, schema, True)
                assert_refused_with_pointer(str(refused.value), backend, keyword, pointer)
            else:
                r = _chat(client, schema, False)
                assert r.choices[0].finish_reason in ("stop", "length"), (name, r)


def _misses(server):
    text = httpx.get(server.base_url + "/metrics").text
    return float(re.search(r"^tpguide:grammar_cache_misses_total ([0-9.e+-]+)$", text, re.M).group(1))


def _whitespace_runs(text):
    """Lengths of the whitespace runs of ``text`` outside JSON strings (the schema's strings hold none)."""
    return [len(m.group(0)) for m in re.finditer(r"[ \t\n\r]+", text)]


@pytest.fixture(scope="module")
def favour_whitespace(tokenizer):
    """``logit_bias`` of +100 on every whitespace-only token: an output has whitespace wherever its grammar allows."""
    ids = [i for i in tokenizer.get_vocab().values() if (t := tokenizer.decode([i])) and not t.strip(" \n\t\r")]
    assert ids
    return {str(i): 100 for i in ids}


def test_served_whitespace_modes_compile_separately_and_each_is_honoured(served, favour_whitespace):
    """compact and bounded are two grammars; unset is the server's default (bounded), found in the cache."""
    _, server, client = served
    texts = {}
    for mode in ("compact", "bounded", None):
        before = _misses(server)
        so = {"json": BOOL_SCHEMA, **({"json_whitespace": mode} if mode else {})}
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "JSON:"}], temperature=0, max_tokens=128,
            logit_bias=favour_whitespace, extra_body={"structured_outputs": so})
        texts[mode] = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (mode, r)
        assert json.loads(texts[mode]).keys() == {"a"}, texts
        assert _misses(server) - before == (0 if mode is None else 1), (mode, texts)  # unset = bounded: a hit
    assert _whitespace_runs(texts["compact"]) == [], texts
    assert _whitespace_runs(texts["bounded"]) and max(_whitespace_runs(texts["bounded"])) <= MAX_BOUNDED_WHITESPACE
    assert texts[None] == texts["bounded"], texts
