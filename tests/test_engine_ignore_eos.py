"""``ignore_eos``: a stop token is output and generation goes on to ``max_tokens`` (vLLM semantics)."""

import json

import pytest

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine
from tpguide.engine.request_io import parse_request_lines, request_from_dict


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    eng = build_engine(TPGroup(), tiny_model_path, EngineConfig(max_num_seqs=2, max_model_len=64))
    yield eng
    eng.shutdown()


def _run(engine, **fields):
    line = json.dumps({"id": "a", "prompt": "Once upon a time", "max_tokens": 8, **fields})
    (out,) = engine.generate(parse_request_lines([line], 8))
    return out


def test_ignore_eos_runs_past_a_stop_token(engine):
    free = _run(engine)
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    stop = free.token_ids[2]
    saved = engine.driver.stop_token_ids
    engine.driver.stop_token_ids = {stop}  # pretend the 3rd greedy token is the model's EOS
    try:
        stopped = _run(engine)
        ignored = _run(engine, ignore_eos=True)
    finally:
        engine.driver.stop_token_ids = saved
    first = free.token_ids.index(stop)
    assert (stopped.token_ids, stopped.finish_reason) == (free.token_ids[: first + 1], "stop")
    assert (ignored.token_ids, ignored.finish_reason) == (free.token_ids, "length")


def test_ignore_eos_must_be_a_bool():
    req = request_from_dict({"id": "a", "prompt": "x", "ignore_eos": "yes"}, 0, 8)
    assert (req.request_id, req.finish_reason) == ("a", "error")
    assert "ignore_eos must be true or false, got 'yes'" in req.error
