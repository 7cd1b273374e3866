"""A freed KV-cache slot (and guided bitmask row) serves the next request as if fresh.

With ``max_num_seqs=1`` every request runs in slot 0 after the previous one
finished: guided, then unguided, then guided again.  Nothing of the old
request may leak in (KV cache beyond ``context_len``, grammar matcher state,
bitmask row), so each must give exactly the tokens it gives alone.
"""

import json

import pytest

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine, generate_on_group
from tpguide.engine.request_io import parse_request_lines

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"]}
REQUESTS = [
    {"id": "guided-json", "prompt": "Answer in JSON:", "structured_output": {"json": SCHEMA}, "max_tokens": 24},
    {"id": "free", "prompt": "Once upon a time there was a", "max_tokens": 16},
    {"id": "guided-regex", "prompt": "code:", "structured_output": {"regex": r"[a-c]{2,4}-\d"}, "max_tokens": 12,
     "temperature": 0.9, "seed": 7},
    {"id": "free-sampled", "prompt": "The sea", "max_tokens": 10, "temperature": 1.0, "top_p": 0.9, "seed": 2},
    {"id": "guided-choice", "messages": [{"role": "user", "content": "colour?"}],
     "structured_output": {"choice": ["red", "green", "blue"]}},
]
ONE_SLOT = EngineConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=256)


@pytest.fixture(scope="module")
def alone(tiny_model_path):
    return [generate_on_group(TPGroup(), tiny_model_path, [r], ONE_SLOT)[0] for r in REQUESTS]


def _run(engine, request_dicts):
    requests = parse_request_lines([json.dumps(r) for r in request_dicts], 64)
    return [o.to_json() for o in engine.generate(requests)]


def test_reused_slot_gives_the_tokens_of_a_fresh_run(tiny_model_path, alone):
    engine = build_engine(TPGroup(), tiny_model_path, ONE_SLOT)
    together = _run(engine, REQUESTS)
    again = _run(engine, REQUESTS[::-1])[::-1]  # a second generate() call on the same engine
    engine.shutdown()
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in together]
    for got, want in zip(together, alone, strict=True):
        assert got["finish_reason"] == want["finish_reason"] != "error", got
        assert got["token_ids"] == want["token_ids"], got["id"]


def test_reused_slots_in_a_wider_engine(tiny_model_path, alone):
    """Two slots, five requests: slots are freed and reused out of order."""
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256)
    together = generate_on_group(TPGroup(), tiny_model_path, REQUESTS, config)
    assert [o["token_ids"] for o in together] == [o["token_ids"] for o in alone]
