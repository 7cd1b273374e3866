"""Receipts and replay on real gloo ranks (docs/receipts.md): a tp-1 output file proved at tp 2 in another batch order.

* tp 1 and tp 2 receipts differ only in the fields marked as not affecting the bits;
* ``replay_lines`` of the tp-1 file at tp 2 in a shuffled order, and at tp 4 one request at a time,
  reports every request identical, and a copy with one hand-altered token id differs at that position
  with both token ids;
* a replay on another model (another random seed) is refused, naming both fingerprints.
"""

from __future__ import annotations

import copy

import pytest

from tpguide.dist import TPGroup
from tpguide.dist.spawn import run_on_ranks
from tpguide.engine import EngineConfig, generate_on_group
from tpguide.engine.receipt import NOT_AFFECTING_BITS, strip_not_affecting
from tpguide.engine.replay import replay_lines

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"]}
REQUESTS = [
    {"id": "schema", "prompt": "Answer in JSON:", "structured_output": {"json": SCHEMA}, "max_tokens": 24,
     "logprobs": 2},
    {"id": "regex", "prompt": "code:", "structured_output": {"regex": r"[a-c]{2,4}-\d"}, "max_tokens": 10,
     "temperature": 0.9, "seed": 4, "logprobs": 1},
    {"id": "choice", "messages": [{"role": "user", "content": "colour?"}],
     "structured_output": {"choice": ["red", "green", "blue"]}, "temperature": 1.0},  # seed derived by the engine
    {"id": "free", "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.7, "top_p": 0.9,
     "logprobs": 3},
]
CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, seed=5)


@pytest.fixture(scope="module")
def recorded(tiny_model_path):
    return generate_on_group(TPGroup(), tiny_model_path, REQUESTS, CONFIG)


def test_tp2_receipts_differ_only_in_fields_that_do_not_fix_the_bits(recorded, tiny_model_path):
    tp2 = run_on_ranks(generate_on_group, 2, tiny_model_path, REQUESTS, CONFIG)[0]
    assert NOT_AFFECTING_BITS == ("engine.not_affecting_bits", "enforcement.speculation")
    for a, b in zip(recorded, tp2, strict=True):
        assert a["receipt"]["engine"]["not_affecting_bits"]["tp_size"] == 1
        assert b["receipt"]["engine"]["not_affecting_bits"]["tp_size"] == 2
        assert strip_not_affecting(a["receipt"]) == strip_not_affecting(b["receipt"]), a["id"]
        assert a["token_ids"] == b["token_ids"] and a.get("logprobs") == b.get("logprobs")


def test_replay_at_tp2_in_another_order_is_identical_and_finds_an_altered_token(recorded, tiny_model_path):
    altered = copy.deepcopy(next(o for o in recorded if o["id"] == "schema"))
    altered["id"] = altered["request"]["id"] = "schema-altered"
    original_token = altered["token_ids"][3]
    altered["token_ids"][3] = original_token + 1
    report = replay_lines(recorded + [altered], tiny_model_path, tp_size=2, batch="shuffle",
                          max_num_seqs=4, max_num_batched_tokens=32)
    assert report["refused"] is None and report["mismatches"] == [] and report["skipped"] == []
    by_id = {r["id"]: r for r in report["results"]}
    for out in recorded:
        assert by_id[out["id"]]["identical"], by_id[out["id"]]
        assert by_id[out["id"]]["receipt_differences"] == []
    diff = by_id["schema-altered"]["difference"]
    assert not by_id["schema-altered"]["identical"]
    assert (diff["index"], diff["recorded_token"], diff["replayed_token"]) == (3, original_token + 1, original_token)
    assert diff["recorded_bits"] == diff["replayed_bits"] is not None  # the logprob was not altered


def test_replay_on_another_model_is_refused_naming_both_fingerprints(recorded, tmp_path, default_model_path):
    from tpguide.model.random_checkpoint import write_random_checkpoint

    other = str(write_random_checkpoint(tmp_path / "other", tokenizer_dir=default_model_path, seed=2))
    report = replay_lines(recorded, other)
    (refusal,) = report["refused"]
    recorded_fp = recorded[0]["receipt"]["model"]["sha256"]
    assert refusal.startswith("model.sha256 differs") and recorded_fp in refusal and report["results"] == []
    here = refusal.split("here ")[1].strip("'")
    assert here.startswith("sha256:") and here != recorded_fp


def test_replay_at_tp4_one_request_at_a_time_is_identical(recorded, tiny_model_path):
    report = replay_lines(recorded, tiny_model_path, tp_size=4, batch="one", max_num_batched_tokens=32)
    assert report["refused"] is None and [r["identical"] for r in report["results"]] == [True] * len(recorded)
