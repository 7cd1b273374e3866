"""Grammar compilation off the step loop: the compile service, a slow grammar timing out end to end,
and running requests that keep stepping while a guide compiles."""

import threading
import time

import pytest

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine, generate_on_group
from tpguide.engine.request_io import request_from_dict
from tpguide.guided.compile_service import CompileService, GrammarCompileTimeout

#: xgrammar 0.2.9 needs about 2 s here to compile this schema (120 optional properties, each with a
#: counted pattern that its regex automaton spells out; one property alone compiles in milliseconds),
#: masks built on first use or not, so a 0.5 s limit fails it with a wide margin.
SLOW_SCHEMA = {"type": "object",
               "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,%d}" % (i + 500)} for i in range(120)}}


def _drain(service, deadline_s=30.0):
    results, end = [], time.monotonic() + deadline_s
    while service.num_pending and time.monotonic() < end:
        service.wait(1.0)
        results += service.collect()
    return results


def test_results_come_back_in_submission_order_and_errors_are_kept():
    service = CompileService(timeout_s=None)
    service.submit("a", lambda: 1)
    service.submit("b", lambda: (_ for _ in ()).throw(ValueError("bad grammar")))
    service.submit("c", lambda: 3)
    results = _drain(service)
    assert [(k, r) for k, r, _ in results] == [("a", 1), ("b", None), ("c", 3)]
    assert isinstance(results[1][2], ValueError) and str(results[1][2]) == "bad grammar"
    with pytest.raises(ValueError, match="already pending"):
        service.submit("x", lambda: None)
        service.submit("x", lambda: None)


def test_a_job_past_its_timeout_is_abandoned_and_the_next_one_still_runs():
    release = threading.Event()
    service = CompileService(timeout_s=0.2)
    service.submit("slow", lambda: release.wait(10) or "late")
    service.submit("fast", lambda: "ok")
    results = dict((k, (r, e)) for k, r, e in _drain(service))
    release.set()
    assert isinstance(results["slow"][1], GrammarCompileTimeout)
    assert "longer than the limit of 0.2 s (--grammar-compile-timeout)" in str(results["slow"][1])
    assert results["fast"] == ("ok", None)  # a replacement worker took it while "slow" overran


def test_bad_arguments():
    with pytest.raises(ValueError, match="timeout must be > 0 seconds or None, got 0"):
        CompileService(timeout_s=0)
    with pytest.raises(ValueError, match="num_workers must be >= 1, got 0"):
        CompileService(num_workers=0)


def test_slow_grammar_times_out_while_the_other_requests_finish(tiny_model_path):
    requests = [
        {"id": "slow", "prompt": "word:", "structured_output": {"json": SLOW_SCHEMA}, "max_tokens": 4},
        {"id": "choice", "prompt": "yes or no:", "structured_output": {"choice": ["yes", "no"]}, "max_tokens": 4},
        {"id": "free", "prompt": "Once upon a time", "max_tokens": 4},
    ]
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, guided_backend="xgrammar",
                          grammar_compile_timeout_s=0.5)
    outputs = {o["id"]: o for o in generate_on_group(TPGroup(), tiny_model_path, requests, config, 4)}
    slow = outputs["slow"]
    assert slow["finish_reason"] == "error" and slow["token_ids"] == [], slow
    assert "grammar compilation took longer than the limit of 0.5 s (--grammar-compile-timeout)" in slow["error"]
    assert outputs["choice"]["finish_reason"] == "stop" and outputs["choice"]["text"] in ("yes", "no")
    assert outputs["free"]["finish_reason"] == "length"


GATED = {"id": "gated", "prompt": "colour?", "structured_output": {"choice": ["red", "green", "blue"]},
         "max_tokens": 8}
RUNNING = {"id": "running", "prompt": "Once upon a time", "max_tokens": 6}


def test_running_requests_keep_stepping_while_a_guide_compiles(tiny_model_path):
    """A guide added between steps compiles in the worker thread; the running request finishes meanwhile.

    The compile of GATED blocks until the test opens the gate, which it does only
    once RUNNING has finished.  A step loop that waited for the compile would
    stall until the gate's own 60 s fallback, which the test detects.
    """
    engine = build_engine(TPGroup(), tiny_model_path, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                                   max_model_len=64, guided_backend="xgrammar"))
    backend = engine.driver.guided_decoder().backend
    gate, compile_started, timed_out = threading.Event(), threading.Event(), []
    real_compile = backend.compile

    def gated_compile(params):
        if params.choice is not None:
            compile_started.set()
            if not gate.wait(60):
                timed_out.append(True)
        return real_compile(params)

    backend.compile = gated_compile
    outputs = {}
    engine.add_request(request_from_dict(RUNNING, 0, 64))
    outputs.update((o.request_id, o) for o in engine.step())
    engine.add_request(request_from_dict(GATED, 1, 64))
    assert compile_started.wait(30)
    steps_during_compile = 0
    while not outputs["running"].finished:
        outputs.update((o.request_id, o) for o in engine.step())
        steps_during_compile += 1
    assert "gated" not in outputs and not timed_out, "a step waited for the compile"
    assert outputs["running"].finish_reason == "length" and len(outputs["running"].token_ids) == 6
    assert steps_during_compile == 5  # one token per step after the first
    gate.set()
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
    engine.shutdown()
    gated = outputs["gated"]
    assert gated.finish_reason == "stop" and gated.text in ("red", "green", "blue"), gated
