"""Speculative decoding gives exactly the non-speculative tokens, at tp 1 and tp 2.

The tiny random model rarely continues a text the way an n-gram lookup
guesses, so besides the real n-gram proposer (repetitive prompts; few drafts
accepted) the tests use an *oracle* proposer that drafts the reference
continuation with deliberate mistakes: whole windows accepted, partial
acceptance, drafts the grammar rejects, stop tokens and ``max_tokens`` inside
a window, filler drafted past the end.  Every case must reproduce the
non-speculative tokens and finish reasons exactly.  ``SPEC`` has the
default grammar drafts in front of the n-gram drafter (its fallback); one
run has the n-gram drafter alone.
"""

import dataclasses
import json

import pytest

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.dist.spawn import run_at_tp_size
from tpguide.engine import EngineConfig, build_engine
from tpguide.engine.request_io import parse_request_lines

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"]}
REQUESTS = [
    {"id": "schema", "prompt": "Answer in JSON:", "structured_output": {"json": SCHEMA}, "max_tokens": 16},
    {"id": "regex", "prompt": "abab abab abab", "structured_output": {"regex": r"(ab){3,8}c"}, "max_tokens": 20},
    {"id": "choice", "prompt": "colour? red green blue red green blue",
     "structured_output": {"choice": ["red green blue", "blue green red"]}},
    {"id": "ebnf", "prompt": "x", "structured_output": {"grammar": 'root ::= "a" [0-9]+ "!"'}, "max_tokens": 9},
    {"id": "repeat-greedy", "prompt": "1 2 3 1 2 3 1 2 3 1 2 3 1 2 3", "max_tokens": 20},
    {"id": "repeat-short", "prompt": "go go go go go go go", "max_tokens": 7},
    {"id": "free-greedy", "prompt": "Once upon a time", "max_tokens": 16},
    {"id": "repeat-sampled", "prompt": "a b a b a b a b", "max_tokens": 14, "temperature": 0.8, "top_k": 20, "seed": 11},
]
BASE = dict(max_num_seqs=4, max_num_batched_tokens=40, max_model_len=128)
PLAIN = EngineConfig(**BASE, speculative_method=None)
SPEC = EngineConfig(**BASE, speculative_method="ngram", num_speculative_tokens=3)


FILLER = 1000  # drafted past the end of a reference output (after its stop token)


class OracleProposer:
    """Drafts the reference continuation of the request; window ``i`` with ``i % 3 == 1`` gets a wrong 2nd draft."""

    def __init__(self, continuations):
        self.continuations = continuations  # {prompt ids tuple: reference output ids}

    def propose(self, token_ids, k):
        for prompt, ref in self.continuations.items():
            n, done = len(prompt), len(token_ids) - len(prompt)
            if done >= 0 and tuple(token_ids[:n]) == prompt and list(token_ids[n:]) == ref[:done]:
                drafts = (ref[done:] + [FILLER] * k)[:k]
                if done % 3 == 1 and k > 1:
                    drafts[1] = (drafts[1] + 1) % 49152
                return drafts
        return []


def generate_with_oracle(group, model_dir, config, reference):
    """Module-level (spawnable): speculative generation with :class:`OracleProposer` on the driver."""
    engine = build_engine(group, model_dir, config)
    result = None
    if group.is_driver:
        requests = parse_request_lines([json.dumps(r) for r in REQUESTS], 64)
        ref = {o["id"]: o["token_ids"] for o in reference}
        engine.driver.spec.proposer = OracleProposer(
            {tuple(engine.driver.tokenize(r)): ref[r.request_id] for r in requests})
        outputs = [o.to_json() for o in engine.generate(requests)]
        engine.shutdown()
        result = (outputs, engine.driver.spec.stats)
    else:
        engine.run_worker()
    return C.broadcast_object(result, group)


def _run_tp1(model_dir, config):
    engine = build_engine(TPGroup(), model_dir, config)
    requests = parse_request_lines([json.dumps(r) for r in REQUESTS], 64)
    outputs = [o.to_json() for o in engine.generate(requests)]
    engine.shutdown()
    return outputs, engine.driver.spec


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    return _run_tp1(tiny_model_path, PLAIN)[0]


def _same(outputs, reference):
    assert [o["id"] for o in outputs] == [o["id"] for o in reference]
    for o, r in zip(outputs, reference):
        assert (o["id"], o["token_ids"], o["finish_reason"]) == (r["id"], r["token_ids"], r["finish_reason"])


@pytest.mark.parametrize("grammar_draft", [True, False], ids=["ngram-as-fallback", "ngram-alone"])
def test_tp1_speculative_equals_plain_and_accepts_drafts(reference, tiny_model_path, grammar_draft):
    outputs, spec = _run_tp1(tiny_model_path, dataclasses.replace(SPEC, grammar_draft=grammar_draft))
    _same(outputs, reference)
    assert all(o["finish_reason"] in ("stop", "length") for o in outputs)
    stats = spec.stats
    assert stats.num_drafted > 0 and stats.num_accepted > 0, stats
    assert stats.num_accepted <= stats.num_drafted
    if grammar_draft:  # forced text where the grammar forces some, n-gram drafts elsewhere
        assert 0 < stats.num_forced_drafted < stats.num_drafted, stats
    else:
        assert stats.num_forced_drafted == 0, stats


@pytest.mark.parametrize("tp_size", [1, 2])
def test_oracle_drafts_speculative_equals_plain(reference, tiny_model_path, tp_size):
    for outputs, stats in run_at_tp_size(generate_with_oracle, tp_size, tiny_model_path, SPEC, reference):
        _same(outputs, reference)
        # most windows are accepted whole; the corrupted ones and the filler are not
        assert stats.num_accepted > stats.num_drafted / 2, stats
        assert stats.num_accepted < stats.num_drafted, stats
