"""``draft-head`` speculative decoding in the engine: exactly the non-speculative tokens, tp 1 and 2.

Two drafters over the 2-layer tiny model:

* **perfect**: both layers and the full vocabulary, i.e. the target itself run
  one token at a time.  Greedy drafts must then be accepted (almost) always,
  guided or not, which checks that drafting sees the same grammar state as
  verification (matcher advanced through the drafts, then rolled back).
* **weak**: one layer, a tuned lens fitted at engine build (the default) and
  an odd-sized pruned vocabulary (padded at tp 2, so rank 1's ``d2t`` slice
  maps into the whole target vocabulary): most drafts are rejected, windows
  end early, the grammar allows no draft id.

Either way every request must reproduce the tokens and finish reason of a
run without speculation.
"""

import dataclasses
import json

import pytest

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.dist.spawn import run_at_tp_size
from tpguide.engine import EngineConfig, build_engine
from tpguide.engine.request_io import parse_request_lines
from tpguide.engine.startup import start_engine
from tpguide.worker.protocol import DriverAborted

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"]}
REQUESTS = [
    {"id": "schema", "prompt": "Answer in JSON:", "structured_output": {"json": SCHEMA}, "max_tokens": 16},
    {"id": "regex", "prompt": "abab", "structured_output": {"regex": r"(ab){3,8}c"}, "max_tokens": 20},
    {"id": "choice", "prompt": "colour?", "structured_output": {"choice": ["red green blue", "blue green red"]}},
    {"id": "free-greedy", "prompt": "Once upon a time", "max_tokens": 17},
    {"id": "free-greedy-2", "prompt": "1 2 3 4", "max_tokens": 9},
    {"id": "sampled", "prompt": "a b a b", "max_tokens": 12, "temperature": 0.8, "top_k": 20, "seed": 11},
]
pytestmark = pytest.mark.usefixtures("lens_cache")  # the weak drafter's lens is cached in a temporary root

GREEDY_IDS = ["schema", "regex", "choice", "free-greedy", "free-greedy-2"]
BASE = dict(max_num_seqs=4, max_num_batched_tokens=40, max_model_len=128)
PERFECT = EngineConfig(**BASE, speculative_method="draft-head", num_speculative_tokens=3,
                       draft_num_layers=2, draft_vocab_size=49152)
WEAK = EngineConfig(**BASE, speculative_method="draft-head", num_speculative_tokens=4,
                    draft_num_layers=1, draft_vocab_size=1001)


def run_requests(group, model_dir, config, ids=None):
    """Module-level (spawnable): outputs and speculative stats on every rank."""
    engine = build_engine(group, model_dir, config)
    result = None
    if group.is_driver:
        chosen = [r for r in REQUESTS if ids is None or r["id"] in ids]
        requests = parse_request_lines([json.dumps(r) for r in chosen], 64)
        outputs = [o.to_json() for o in engine.generate(requests)]
        engine.shutdown()
        spec = engine.driver.spec
        result = (outputs, spec.stats if spec else None)
    else:
        engine.run_worker()
    return C.broadcast_object(result, group)


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    return run_requests(TPGroup(), tiny_model_path, EngineConfig(**BASE, speculative_method=None))[0]


def _same(outputs, reference, ids=None):
    expected = [r for r in reference if ids is None or r["id"] in ids]
    assert [(o["id"], o["token_ids"], o["finish_reason"]) for o in outputs] == \
        [(r["id"], r["token_ids"], r["finish_reason"]) for r in expected]
    assert all(o["finish_reason"] in ("stop", "length") for o in outputs)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_perfect_drafter_equals_plain_and_is_accepted(reference, tiny_model_path, tp_size):
    for outputs, stats in run_at_tp_size(run_requests, tp_size, tiny_model_path, PERFECT, GREEDY_IDS):
        _same(outputs, reference, GREEDY_IDS)
        head_drafted = stats.num_drafted - stats.num_forced_drafted  # grammar drafts (layouts) are guesses
        head_accepted = stats.num_accepted - stats.num_forced_accepted
        assert head_drafted > 20, stats
        assert head_accepted >= 0.9 * head_drafted, stats  # the drafter is the target


def test_perfect_drafter_alone_equals_plain(reference, tiny_model_path):
    """Without grammar drafts in front of it (``PERFECT`` has them: the draft head is their fallback)."""
    alone = dataclasses.replace(PERFECT, grammar_draft=False)
    outputs, stats = run_requests(TPGroup(), tiny_model_path, alone, GREEDY_IDS)
    _same(outputs, reference, GREEDY_IDS)
    assert stats.num_forced_drafted == 0 and stats.num_accepted >= 0.9 * stats.num_drafted > 20, stats


@pytest.mark.parametrize("tp_size", [1, 2])
def test_weak_drafter_equals_plain(reference, tiny_model_path, tp_size):
    for outputs, stats in run_at_tp_size(run_requests, tp_size, tiny_model_path, WEAK):
        _same(outputs, reference)
        assert stats.num_drafted > 0 and stats.num_accepted < stats.num_drafted, stats


def test_engine_needs_a_draft_head_exactly_with_draft_head_method(tiny_model_path):
    engine = build_engine(TPGroup(), tiny_model_path, EngineConfig(**BASE))
    with pytest.raises(ValueError, match="draft head is needed"):
        start_engine(engine.model, engine.group, PERFECT, tokenizer=engine.driver.tokenizer)


def fail_after_head_drafting(group, model_dir):
    """Module-level (spawnable): the driver fails in plan_step, after the drafting loop; what each rank saw."""
    engine = build_engine(group, model_dir, PERFECT)
    try:
        if group.is_driver:
            def fail(*args):
                raise RuntimeError("injected failure after drafting")

            engine.driver.plan_step = fail
            engine.generate(parse_request_lines([json.dumps(REQUESTS[3])], 64))
        else:
            engine.run_worker()
        return None
    except (RuntimeError, DriverAborted) as exc:
        return f"{type(exc).__name__}: {exc}"


def test_a_driver_failure_after_head_drafting_aborts_the_other_ranks(tiny_model_path):
    """The drafting loop's collectives end before plan_step: a failure there is an ABORT the other rank reads."""
    driver, worker = run_at_tp_size(fail_after_head_drafting, 2, tiny_model_path)
    assert driver == "RuntimeError: injected failure after drafting"
    assert worker.startswith("DriverAborted: rank 1: the driver (rank 0) failed between steps"), worker
