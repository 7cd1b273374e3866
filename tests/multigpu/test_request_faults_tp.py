"""A request that makes the engine raise fails alone at tp 2 too, and every rank stays in step (gloo).

``launch/generate.py`` under ``torchrun --nproc-per-node 2`` with
``TPGUIDE_REQUEST_FAULT`` (tpguide/engine/request_faults.py): the request
whose step raises on the driver ends ``"error"`` with ``server_fault``, the
others give tp 1's tokens without the fault, bit for bit, and the job exits
0.  A run whose every request fails exits 1 after writing every error line.
"""

import pytest
from server_process import run_generate

pytestmark = pytest.mark.slow

LINES = [
    {"id": "free", "prompt": "Once upon a time", "max_tokens": 8},
    {"id": "faulty", "prompt": "FAULT-HERE: a JSON object", "max_tokens": 8,
     "structured_output": {"json": {"type": "object", "properties": {"n": {"type": "integer"}}}}},
    {"id": "json", "prompt": "A JSON object:", "max_tokens": 12,
     "structured_output": {"json": {"type": "object", "properties": {"s": {"type": "string"}}}}},
]
ARGS = ["--max-num-seqs", "4", "--max-model-len", "128", "--quiet"]


def test_a_faulty_request_fails_alone_at_tp2(tiny_model_path):
    args = ["--model", tiny_model_path, *ARGS]
    reference, _ = run_generate(1, LINES, args)
    for phase in ("finish",):  # inside the step (the admit phase is tests/test_request_faults.py)
        outputs, _ = run_generate(2, LINES, args, env={"TPGUIDE_REQUEST_FAULT": f"{phase}:FAULT-HERE"})
        by_id = {o["id"]: o for o in outputs}
        faulty = by_id["faulty"]
        assert faulty["finish_reason"] == "error" and faulty.get("server_fault") is True, faulty
        assert f"InjectedFault: TPGUIDE_REQUEST_FAULT: {phase} fault" in faulty["error"]
        for ref in reference:
            if ref["id"] != "faulty":
                assert by_id[ref["id"]]["token_ids"] == ref["token_ids"], ref["id"]
                assert by_id[ref["id"]]["text"] == ref["text"]


def test_a_run_where_every_request_fails_exits_1(tiny_model_path):
    lines = [{"id": "a", "prompt": "x", "max_tokens": 0}, {"id": "b", "messages": "not a list"}]
    outputs, _ = run_generate(1, lines, ["--model", tiny_model_path, *ARGS], expect_status=1)
    assert [o["finish_reason"] for o in outputs] == ["error", "error"]
