"""Speculation with EOS inside an accepted draft window ends exactly as plain decoding.

Guided requests with ``ignore_eos: true`` end with ``"stop"`` at the first
token that terminates the grammar matcher.  With speculation the window can
hold that EOS followed by more tokens (drafted filler, or the bonus token of
the row after it); the request must still end at the EOS with ``"stop"``,
not with ``"error"`` ("grammar matcher rejected token"), for ``ngram`` (an
oracle proposer that drafts the reference continuation and filler past its
end) and ``draft-head`` (a perfect drafter, which drafts the EOS the grammar
forces), at tp 1 and tp 2.
"""

import json

import pytest

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.dist.spawn import run_at_tp_size
from tpguide.engine import EngineConfig, build_engine
from tpguide.engine.request_io import parse_request_lines

REQUESTS = [
    {"id": "regex", "prompt": "abab abab abab", "structured_output": {"regex": r"(ab){3,4}c"}, "max_tokens": 20,
     "ignore_eos": True},
    {"id": "choice", "prompt": "colour? red green blue", "structured_output": {"choice": ["red green", "blue"]},
     "ignore_eos": True},
    {"id": "ebnf", "prompt": "x", "structured_output": {"grammar": 'root ::= "a" [0-9] "!"'}, "max_tokens": 9,
     "ignore_eos": True},
    {"id": "free", "prompt": "1 2 3 1 2 3 1 2 3", "max_tokens": 12, "ignore_eos": True},
]
BASE = dict(max_num_seqs=4, max_num_batched_tokens=40, max_model_len=128)
PLAIN = EngineConfig(**BASE, speculative_method=None)
NGRAM = EngineConfig(**BASE, speculative_method="ngram", num_speculative_tokens=4)
DRAFT_HEAD = EngineConfig(**BASE, speculative_method="draft-head", num_speculative_tokens=3, draft_num_layers=2,
                          draft_vocab_size=49152)
FILLER = 1000


class EosOracle:
    """Drafts the reference continuation, then filler; counts windows with a stop token before their end."""

    def __init__(self, continuations, stop_ids):
        self.continuations, self.stop_ids, self.eos_windows = continuations, stop_ids, 0

    def propose(self, token_ids, k):
        for prompt, ref in self.continuations.items():
            n, done = len(prompt), len(token_ids) - len(prompt)
            if done >= 0 and tuple(token_ids[:n]) == prompt and list(token_ids[n:]) == ref[:done]:
                drafts = (ref[done:] + [FILLER] * k)[:k]
                self.eos_windows += any(t in self.stop_ids for t in drafts[:-1])
                return drafts
        return []


def run(group, model_dir, config, reference=None):
    """Module-level (spawnable): outputs (and oracle windows with EOS) on every rank."""
    engine = build_engine(group, model_dir, config)
    result = None
    if group.is_driver:
        requests = parse_request_lines([json.dumps(r) for r in REQUESTS], 64)
        oracle = None
        if reference is not None and config.speculative_method == "ngram":
            ref = {o["id"]: o["token_ids"] for o in reference}
            oracle = EosOracle({tuple(engine.driver.tokenize(r)): ref[r.request_id] for r in requests},
                               engine.driver.stop_token_ids)
            engine.driver.spec.proposer = oracle
        outputs = [o.to_json() for o in engine.generate(requests)]
        engine.shutdown()
        stats = engine.driver.spec.stats if engine.driver.spec else None
        result = (outputs, oracle.eos_windows if oracle else None, stats)
    else:
        engine.run_worker()
    return C.broadcast_object(result, group)


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    outputs = run(TPGroup(), tiny_model_path, PLAIN)[0]
    by_id = {o["id"]: o for o in outputs}
    for rid in ("regex", "choice", "ebnf"):  # the grammar ends them, EOS included, despite ignore_eos
        assert by_id[rid]["finish_reason"] == "stop", by_id[rid]
    return outputs


def _same(outputs, reference):
    assert [(o["id"], o["token_ids"], o["finish_reason"], o["error"]) for o in outputs] == \
        [(r["id"], r["token_ids"], r["finish_reason"], r["error"]) for r in reference]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_ngram_with_eos_inside_the_window_equals_plain(reference, tiny_model_path, tp_size):
    for outputs, eos_windows, stats in run_at_tp_size(run, tp_size, tiny_model_path, NGRAM, reference):
        _same(outputs, reference)
        assert eos_windows >= 2, eos_windows  # windows with EOS and drafts after it
        assert stats.num_accepted > 0


@pytest.mark.usefixtures("lens_cache")
@pytest.mark.parametrize("tp_size", [1, 2])
def test_draft_head_with_eos_inside_the_window_equals_plain(reference, tiny_model_path, tp_size):
    for outputs, _, stats in run_at_tp_size(run, tp_size, tiny_model_path, DRAFT_HEAD, reference):
        _same(outputs, reference)
        assert stats.num_accepted >= 0.9 * stats.num_drafted > 0, stats
