"""The engine API (add_request / abort_request / step / has_unfinished_requests) at tp 1 and tp 2 (gloo).

* a request added while another is decoding joins between steps and gives
  the tokens it gives alone;
* aborting a guided request mid-decode finishes it with ``"abort"``, frees
  its slot and matcher, and the next request in that slot gives the tokens
  of a fresh engine;
* the step deltas (``new_token_ids``, ``new_logprobs``) concatenate to the
  final output;
* an idle ``step()`` returns at once and makes no collective call (also when
  it reports a request that failed at admission).
"""

from collections import defaultdict

import pytest

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.dist.spawn import run_at_tp_size
from tpguide.engine import EngineConfig, build_engine, generate_on_group
from tpguide.engine.request_io import request_from_dict

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"]}
FIRST = {"id": "first", "prompt": "Answer in JSON:", "structured_output": {"json": SCHEMA}, "max_tokens": 20,
         "logprobs": 2}
JOINER = {"id": "joiner", "prompt": "The sea", "max_tokens": 10, "temperature": 0.9, "seed": 2, "logprobs": 1}
ABORTED = {"id": "aborted", "prompt": "code:", "structured_output": {"regex": r"[a-c]{8,12}-\d"}, "max_tokens": 16}
NEXT = {"id": "next", "prompt": "colour?", "structured_output": {"choice": ["red", "green", "blue"]},
        "max_tokens": 8}
BAD = {"id": "bad", "prompt": "x", "structured_output": {"regex": "(unclosed"}}
CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
ONE_SLOT = EngineConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=128)
JOIN_AFTER = 3  # the joiner is added after this many steps
COLLECTIVES = ("broadcast_object", "broadcast_tensor", "scatter_tensor", "all_gather_stacked", "all_reduce")


def _req(obj, index=0):
    return request_from_dict(obj, index, 64)


def _drain(engine, record, add_after=None):
    """Step until done; ``record[id]`` collects every output; ``add_after = (n, request)`` joins after step n.

    Returns ``(running_at_join, first_step)``: what had run when the request was
    added (id -> (tokens, finished)) and the step of each request's first output.
    """
    steps, running_at_join, first_step = 0, None, {}
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            record[out.request_id].append(out)
            first_step.setdefault(out.request_id, steps)
        if add_after is not None and steps == add_after[0]:
            running_at_join = {rid: (len(outs[-1].token_ids), outs[-1].finished) for rid, outs in record.items()}
            engine.add_request(add_after[1])
    return running_at_join, first_step


def _summary(outs):
    final = outs[-1]
    deltas = [t for o in outs for t in o.new_token_ids]
    new_lps = [e for o in outs for e in (o.new_logprobs or [])]
    return {"token_ids": final.token_ids, "finish_reason": final.finish_reason, "deltas": deltas,
            "new_logprobs": new_lps, "logprobs": final.logprobs, "num_outputs": len(outs),
            "finished_flags": [o.finished for o in outs]}


def _count_collectives(fn):
    calls = []
    saved = {name: getattr(C, name) for name in COLLECTIVES}
    for name, f in saved.items():
        setattr(C, name, lambda *a, _n=name, _f=f, **k: (calls.append(_n), _f(*a, **k))[1])
    try:
        return fn(), calls
    finally:
        for name, f in saved.items():
            setattr(C, name, f)


def api_scenarios(group, model_dir):
    """Module-level (spawnable): every scenario on this group; every rank returns the driver's findings."""
    found = None
    engine = build_engine(group, model_dir, CONFIG)
    if group.is_driver:
        found = {}
        record = defaultdict(list)
        engine.add_request(_req(FIRST))
        found["running_at_join"], found["first_step"] = _drain(engine, record, add_after=(JOIN_AFTER, _req(JOINER, 1)))
        found["first"], found["joiner"] = _summary(record["first"]), _summary(record["joiner"])
        found["idle"] = _count_collectives(engine.step)
        engine.add_request(_req(BAD, 2))
        found["idle_bad"] = _count_collectives(engine.step)
        found["idle_bad_after"] = engine.has_unfinished_requests()
        engine.keepalive()
        engine.shutdown()
    else:
        engine.run_worker()
    engine = build_engine(group, model_dir, ONE_SLOT)
    if group.is_driver:
        drv = engine.driver
        record = defaultdict(list)
        engine.add_request(_req(ABORTED))
        while len(drv.scheduler.running) == 0 or not record["aborted"] or len(record["aborted"][-1].token_ids) < 3:
            for out in engine.step():
                record[out.request_id].append(out)
        found["aborted_running"] = not record["aborted"][-1].finished
        engine.abort_request("aborted")
        outs = engine.step()
        found["abort_outputs"] = [(o.request_id, o.finish_reason, len(o.token_ids)) for o in outs]
        found["slot_freed"] = (drv.scheduler.running == {} and drv.scheduler.free_slots == [0]
                               and not drv.guided.is_guided(0))
        engine.add_request(_req(NEXT, 1))
        engine.add_request(_req(dict(ABORTED, id="waiting"), 2))
        engine.abort_request("waiting")  # still waiting: finishes without running
        _drain(engine, record)
        found["next"] = _summary(record["next"])
        found["waiting"] = _summary(record["waiting"])
        engine.shutdown()
    else:
        engine.run_worker()
    return C.broadcast_object(found, group)


@pytest.fixture(scope="module")
def alone(tiny_model_path):
    """Each request alone in a fresh engine."""
    return {r["id"]: generate_on_group(TPGroup(), tiny_model_path, [r], config)[0]
            for r, config in ((FIRST, CONFIG), (JOINER, CONFIG), (NEXT, ONE_SLOT))}


@pytest.mark.parametrize("tp_size", [1, 2])
def test_engine_api(tiny_model_path, alone, tp_size):
    for found in run_at_tp_size(api_scenarios, tp_size, tiny_model_path):
        # join between steps (when the first request's admission finished does not matter): the first
        # request was mid-decode, the joiner's first output came in a later step, its tokens are as alone
        ((rid, (num_tokens, finished)),) = found["running_at_join"].items()
        assert rid == "first" and not finished and 1 <= num_tokens < len(found["first"]["token_ids"])
        assert found["first_step"]["joiner"] > JOIN_AFTER >= found["first_step"]["first"]
        for rid in ("first", "joiner", "next"):
            got, want = found[rid], alone[rid]
            assert (got["token_ids"], got["finish_reason"]) == (want["token_ids"], want["finish_reason"]), rid
            # deltas concatenate to the final output; only the last output is finished
            assert got["deltas"] == got["token_ids"], rid
            assert got["finished_flags"] == [False] * (got["num_outputs"] - 1) + [True], rid
        assert found["first"]["num_outputs"] > 3 and found["first"]["finish_reason"] != "error"
        for rid in ("first", "joiner"):
            assert found[rid]["new_logprobs"] == found[rid]["logprobs"], rid  # the delta entries, in order
            # values differ from the lone run in the last float bits (another batch shape), the ids do not
            assert [e["token_id"] for e in found[rid]["logprobs"]] == alone[rid]["token_ids"], rid
        # idle steps: no collective, the admission error reported at once
        assert found["idle"] == ([], [])
        outs, calls = found["idle_bad"]
        assert calls == [] and [(o.request_id, o.finish_reason) for o in outs] == [("bad", "error")]
        assert "regex" in outs[0].error.lower() and found["idle_bad_after"] is False
        # abort mid-decode frees the slot; the next request there equals a fresh engine's
        assert found["aborted_running"] and found["slot_freed"]
        assert len(found["abort_outputs"]) == 1
        rid, reason, num_tokens = found["abort_outputs"][0]
        assert (rid, reason) == ("aborted", "abort") and num_tokens >= 3
        assert (found["waiting"]["token_ids"], found["waiting"]["finish_reason"]) == ([], "abort")
