"""Dead ends and non-finite logits fail one request; the rest of the batch is untouched (tp 1)."""

import json
import math

import pytest

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine, generate_on_group
from tpguide.engine.request_io import parse_request_lines
from tpguide.guided.decoder import GuidedDecoder
from tpguide.guided.xgrammar_backend import XGrammarMatcher
from tpguide.worker.faults import describe_bad_rows, nonfinite_ranks

CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
DEAD_REGEX = "[a-z]{1,20}"
REQUESTS = [
    {"id": "free", "prompt": "Once upon a time", "max_tokens": 6},
    {"id": "guided", "prompt": "word:", "structured_output": {"regex": DEAD_REGEX}, "max_tokens": 6},
    {"id": "schema", "prompt": "JSON:", "max_tokens": 10,
     "structured_output": {"json": {"type": "object", "properties": {"n": {"type": "integer"}}}}},
]


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    return {o["id"]: o for o in generate_on_group(TPGroup(), tiny_model_path, REQUESTS, CONFIG)}


def run(tiny_model_path, patch_engine=None):
    engine = build_engine(TPGroup(), tiny_model_path, CONFIG)
    if patch_engine is not None:
        patch_engine(engine)
    outputs = engine.generate(parse_request_lines([json.dumps(r) for r in REQUESTS], 8))
    engine.shutdown()
    return {o.id: o.to_json() for o in outputs}


def assert_only_failed(outputs, reference, failed_id, num_tokens):
    for rid, ref in reference.items():
        if rid == failed_id:
            assert outputs[rid]["token_ids"] == ref["token_ids"][:num_tokens]
        else:
            assert outputs[rid] == ref


def test_non_finite_logits_fail_one_request_with_step_and_rank(tiny_model_path, reference, capfd):
    def inject_nan(engine):
        compute_logits, calls = engine.model.compute_logits, [0]

        def patched(hidden):
            logits = compute_logits(hidden)
            calls[0] += 1
            if calls[0] == 3:  # step 3: rows = the three requests' decode tokens (slot order)
                logits[1, 100] = math.nan
            return logits

        engine.model.compute_logits = patched

    outputs = run(tiny_model_path, inject_nan)
    failed = outputs["guided"]
    assert failed["finish_reason"] == "error"
    assert failed["error"] == "non-finite logits at step 3: NaN or +inf logits on rank(s) [0]"
    assert "[rank 0] step 3: request 'guided' failed: non-finite logits" in capfd.readouterr().err
    assert_only_failed(outputs, reference, "guided", 2)


def test_grammar_dead_end_fails_one_request_before_softmax(tiny_model_path, reference, monkeypatch):
    add_request = GuidedDecoder.add_request

    def tagging_add_request(self, slot, params, thinking=None, compiled=None):
        add_request(self, slot, params, thinking, compiled=compiled)
        if params is not None and params.regex == DEAD_REGEX:
            self.record(slot).matcher.dead_after = 2

    fill = XGrammarMatcher.fill_next_token_bitmask

    def dead_end_fill(self, bitmask, row):
        fill(self, bitmask, row)
        if self.num_accepted_tokens >= getattr(self, "dead_after", math.inf):
            bitmask[row].zero_()  # no token allowed: a dead end

    monkeypatch.setattr(GuidedDecoder, "add_request", tagging_add_request)
    monkeypatch.setattr(XGrammarMatcher, "fill_next_token_bitmask", dead_end_fill)
    outputs = run(tiny_model_path)
    failed = outputs["guided"]
    assert failed["finish_reason"] == "error"
    assert "grammar dead end at step 3" in failed["error"] and "after 2 generated tokens" in failed["error"]
    assert_only_failed(outputs, reference, "guided", 2)


def test_matcher_error_while_filling_is_reported_with_its_reason(tiny_model_path, reference, monkeypatch):
    add_request = GuidedDecoder.add_request

    def tagging_add_request(self, slot, params, thinking=None, compiled=None):
        add_request(self, slot, params, thinking, compiled=compiled)
        if params is not None and params.regex == DEAD_REGEX:
            self.record(slot).matcher.raise_after = 2

    fill = XGrammarMatcher.fill_next_token_bitmask

    def raising_fill(self, bitmask, row):
        if self.num_accepted_tokens >= getattr(self, "raise_after", math.inf):
            raise RuntimeError("matcher state corrupted (injected)")
        fill(self, bitmask, row)

    monkeypatch.setattr(GuidedDecoder, "add_request", tagging_add_request)
    monkeypatch.setattr(XGrammarMatcher, "fill_next_token_bitmask", raising_fill)
    outputs = run(tiny_model_path)
    failed = outputs["guided"]
    assert failed["finish_reason"] == "error" and "dead end" not in failed["error"]
    assert "at step 3 after 2 generated tokens" in failed["error"]
    assert "matcher error while filling the bitmask: matcher state corrupted (injected)" in failed["error"]
    assert_only_failed(outputs, reference, "guided", 2)


def test_nonfinite_ranks_and_descriptions():
    import torch

    logits = torch.tensor([[0.0, 1.0], [math.nan, 0.0], [-math.inf, -math.inf], [math.inf, 0.0]])
    ranks = nonfinite_ranks(logits, TPGroup())
    assert ranks == [[], [0], [], [0]]
    notes = describe_bad_rows(ranks)
    assert notes[1] == "NaN or +inf logits on rank(s) [0]" and "every token -inf" in notes[2]
