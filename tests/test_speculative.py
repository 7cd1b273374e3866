"""Speculative decoding, pure parts: acceptance rule, n-gram drafts, config, the grammar rows of a verify pass."""

import pytest

from tpguide.engine import EngineConfig
from tpguide.speculative.ngram import NgramProposer
from tpguide.speculative.verify import num_accepted_drafts


def test_acceptance_is_the_longest_agreeing_prefix():
    assert num_accepted_drafts([5, 6, 7], [5, 6, 9, 1]) == 2
    assert num_accepted_drafts([5, 6, 7], [4, 6, 7, 1]) == 0
    assert num_accepted_drafts([5, 6, 7], [5, 6, 7, 8]) == 3
    assert num_accepted_drafts([], [8]) == 0
    with pytest.raises(ValueError, match="1 \\+ k"):
        num_accepted_drafts([1, 2], [1, 2])


def test_ngram_prefers_the_longest_then_the_most_recent_match():
    p = NgramProposer(max_n=3)
    #            0  1  2  3  4  5  6  7  8  9
    history = [1, 2, 3, 9, 1, 2, 3, 8, 2, 3]
    # last 3 = (8, 2, 3) never occurs before; last 2 = (2, 3) most recently at 5..6 -> 8, 2, 3
    assert p.propose(history, 3) == [8, 2, 3]
    assert p.propose([7, 1, 2, 3, 4, 0, 1, 2, 3], 2) == [4, 0]  # 3-gram (1, 2, 3)
    assert p.propose([1, 2, 3], 4) == []  # nothing repeats
    assert p.propose([5], 4) == []
    assert p.propose([1, 2, 1, 2], 0) == []


def test_ngram_copies_a_short_period_through_its_own_drafts():
    assert NgramProposer().propose([4, 1, 2, 3, 1, 2, 3], 5) == [1, 2, 3, 1, 2]
    assert NgramProposer().propose([7, 7, 7], 3) == [7, 7, 7]


@pytest.mark.parametrize("kwargs, match", [
    (dict(speculative_method="beam"), "speculative_method"),
    (dict(speculative_method=None, num_speculative_tokens=2), "needs a speculative_method"),
    (dict(speculative_method="grammar", grammar_draft=False), "speculative_method=None"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative_method="draft-head", num_speculative_tokens=2, draft_num_layers=0), "draft_num_layers"),
    (dict(speculative_method="draft-head", num_speculative_tokens=2, draft_vocab_size=0), "draft_vocab_size"),
])
def test_engine_config_validates_speculative_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("method", ["grammar", "ngram", "draft-head"])
def test_engine_config_accepts_every_method(method):
    cfg = EngineConfig(speculative_method=method, num_speculative_tokens=3)
    assert cfg.num_speculative_tokens == 3


def test_engine_config_defaults_to_grammar_drafts_with_k_4():
    cfg = EngineConfig()
    assert (cfg.speculative_method, cfg.grammar_draft, cfg.num_speculative_tokens) == ("grammar", True, 4)
    off = EngineConfig(speculative_method=None)
    assert off.num_speculative_tokens == 0


def test_draft_head_speculator_reserves_placeholders():
    from tpguide.engine.drafting import draft_input_of
    from tpguide.engine.request import Request, SamplingParams
    from tpguide.speculative.propose import DRAFT_PENDING, Speculator

    spec = Speculator("draft-head", 3, max_model_len=64)
    req = Request("r", 0, SamplingParams(max_tokens=10), prompt_token_ids=[1, 2], output_token_ids=[5])
    req.slot = 0
    req = draft_input_of(req)
    assert spec.propose(req, budget=8) == [DRAFT_PENDING] * 3
    assert spec.propose(req, budget=3) == [DRAFT_PENDING] * 2  # the golden token takes one


@pytest.fixture(scope="module")
def spec_decoder(default_model_path):
    from transformers import AutoTokenizer

    from tpguide.guided import make_backend
    from tpguide.guided.decoder import GuidedDecoder

    tok = AutoTokenizer.from_pretrained(default_model_path)
    backend = make_backend("xgrammar", tok, 49152, [2])
    return GuidedDecoder(backend, 49152, 2 * 4), tok


def _ids(tok, text):
    return [tok.convert_tokens_to_ids(ch) for ch in text]


def test_fill_with_drafts_guides_the_accepted_drafts_and_rolls_back_at_once(spec_decoder):
    from tpguide.guided import StructuredOutputsParams, unpack_bitmask

    decoder, tok = spec_decoder
    a, b, c, x = _ids(tok, "abcx")
    decoder.add_request(0, StructuredOutputsParams.from_request({"regex": "abcabc"}))
    assert decoder.accept_token(0, a)  # a verified token
    # drafts b c x: b, c accepted by the grammar, x rejected -> rows 0..2 guided, row 3 not
    bitmask, mask, dead = decoder.fill_bitmask_with_drafts([(0, [b, c, x]), (None, [])])
    assert dead == [] and mask.tolist() == [1, 1, 1, 0, 0]
    allowed = unpack_bitmask(bitmask, 49152)
    assert allowed[0, b] and not allowed[0, c]  # after "a"
    assert allowed[1, c] and allowed[2, a]  # after "ab", after "abc"
    assert decoder.record(0).matcher.num_accepted_tokens == 1  # rolled back at once: "a" only
    assert decoder.accepted_prefix(0, [b, c, x, a]) == [b, c]
    assert decoder.accept_token(0, b) and decoder.accept_token(0, c)  # the verified window, then on


def test_fill_with_a_stop_token_drafted_leaves_the_rest_unguided(spec_decoder):
    from tpguide.guided import StructuredOutputsParams

    decoder, tok = spec_decoder
    a, b, c = _ids(tok, "abc")
    decoder.add_request(1, StructuredOutputsParams.from_request({"regex": "abc"}))
    assert decoder.accept_token(1, a)
    bitmask, mask, dead = decoder.fill_bitmask_with_drafts([(1, [b, c, 2, a])])
    assert dead == [] and mask.tolist() == [1, 1, 1, 0, 0]  # row 3 follows the stop token
    assert not decoder.is_terminated(1) and decoder.record(1).matcher.num_accepted_tokens == 1
    assert decoder.accepted_prefix(1, [b, c, 2, a]) == [b, c, 2]  # nothing after the stop token


def test_scheduler_drafts_never_starve_a_later_decode():
    from tpguide.engine.request import Request, SamplingParams
    from tpguide.engine.scheduler import Scheduler

    sched = Scheduler(3, 6)
    for i in range(3):
        req = Request(f"r{i}", i, SamplingParams(max_tokens=10), prompt_token_ids=[1, 2], output_token_ids=[5])
        req.slot, req.num_computed_tokens = i, 2
        sched.running[i] = req
    seqs = sched.schedule({i: [7] * 5 for i in range(3)})  # the drafting phase's drafts, cut to the budget
    assert [(s.slot, s.num_draft_tokens, len(s.token_ids)) for s in seqs] == [(0, 3, 4), (1, 0, 1), (2, 0, 1)]
    assert seqs[0].token_ids == [5, 7, 7, 7] and seqs[0].start_position == 2
