"""``Engine.step(finished_only=True)`` (what ``generate`` runs) gives the final outputs of the reporting step loop.

docs/gpu.md "The host side of a step": ``generate`` reads only the final
outputs, so its steps build none for the running requests (no copies, no
incremental text).  A final output must not notice: the same ids, text,
logprobs, finish reason and the same last delta (``new_token_ids``).
"""

import dataclasses
import json

import pytest

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine
from tpguide.engine.request_io import parse_request_lines

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"]}
REQUESTS = [
    {"id": "guided", "prompt": "Answer in JSON:", "structured_output": {"json": SCHEMA}, "max_tokens": 24,
     "logprobs": 2},
    {"id": "free", "prompt": "Once upon a time there was a", "max_tokens": 16, "prompt_logprobs": 1},
    {"id": "sampled", "prompt": "The sea", "max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "seed": 2,
     "logprobs": 1},
]


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    # no prefix cache: the runs below repeat the same prompts and must compute the same way
    eng = build_engine(TPGroup(), tiny_model_path, EngineConfig(max_num_seqs=4, max_model_len=128,
                                                                enable_prefix_caching=False))
    yield eng
    eng.shutdown()


def _requests(stop: str):
    """REQUESTS and one cut by ``stop`` (a piece of the ``free`` request's text: it stops on the way)."""
    stopped = {"id": "stopped", "prompt": "Once upon a time there was a", "max_tokens": 16, "stop": [stop]}
    return parse_request_lines([json.dumps(r) for r in REQUESTS + [stopped]], 64)


def _final(out):
    return dataclasses.replace(out, elapsed_s=0.0)


def test_generate_reports_the_final_outputs_of_every_step_reported(engine):
    (free,) = engine.generate(parse_request_lines([json.dumps(REQUESTS[1])], 64))
    stop = free.text[len(free.text) // 2:][:3]
    for req in _requests(stop):
        engine.add_request(req)
    engine.wait_for_admissions()
    reported, running = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            running += not out.finished
            if out.finished:
                reported[out.index] = _final(out)
    assert running > len(reported)  # the reporting loop built the running requests' outputs

    for req in _requests(stop):
        engine.add_request(req)
    engine.wait_for_admissions()
    quiet = {}
    while engine.has_unfinished_requests():
        outs = engine.step(finished_only=True)
        assert all(out.finished for out in outs)
        quiet.update((out.index, _final(out)) for out in outs)

    generated = [_final(out) for out in engine.generate(_requests(stop))]
    assert [reported[i] for i in range(len(generated))] == [quiet[i] for i in range(len(generated))] == generated
    by_id = {out.request_id: out for out in generated}
    assert by_id["stopped"].finish_reason == "stop" and by_id["stopped"].text == free.text[:free.text.index(stop)]
    assert by_id["guided"].logprobs and by_id["free"].prompt_logprobs
    assert all(len(by_id[i].token_ids) > len(by_id[i].new_token_ids) > 0 for i in ("guided", "stopped"))
