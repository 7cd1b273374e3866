"""Speculative decoding, pure parts: grammar counters, acceptance rule, n-gram drafts, config."""

import pytest

from tpguide.engine.engine import EngineConfig
from tpguide.guided.spec_counters import SlotCounters, SpecAccountingError, num_accepted_drafts
from tpguide.speculative.ngram import NgramProposer


def _window(num_drafts_advanced: int, terminated: bool = False) -> SlotCounters:
    c = SlotCounters()
    c.begin_step()  # golden token
    for _ in range(num_drafts_advanced):
        c.advance_draft()
    c.matcher_terminated = terminated
    return c


def test_six_advanced_two_accepted_rolls_back_three():
    c = _window(5)  # golden + 5 drafts = 6 advanced
    assert c.num_advanced_tokens == 6 and c.num_advanced_draft_tokens == 5
    assert c.rollback_count(2) == 3  # 6 - (1 + 2)


@pytest.mark.parametrize("accepted, rollback", [(0, 4), (1, 3), (4, 0)])
def test_rollback_is_advanced_minus_one_plus_accepted(accepted, rollback):
    assert _window(4).rollback_count(accepted) == rollback


def test_eos_drafted_then_more_drafts_accepted_is_clamped():
    # drafts: d1 d2 EOS d4 d5; the matcher stopped after EOS (3 drafts advanced),
    # the target agreed with all 5: only 3 count, nothing to roll back
    c = _window(3, terminated=True)
    assert c.accepted_drafts(5) == 3
    assert c.rollback_count(5) == 0


def test_eos_drafted_but_rejected_before_it_rolls_back():
    c = _window(3, terminated=True)
    assert c.rollback_count(1) == 2


def test_negative_rollback_is_reported_not_hidden():
    c = _window(2)  # the grammar stopped at d3, yet the target "accepted" 3: a bug
    with pytest.raises(SpecAccountingError, match="negative rollback -1"):
        c.rollback_count(3)
    with pytest.raises(SpecAccountingError, match="golden"):
        SlotCounters().rollback_count(0)


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
    (dict(num_speculative_tokens=2), "needs a speculative_method"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative_method="draft-head", num_speculative_tokens=2, draft_num_layers=0), "draft_num_layers"),
    (dict(speculative_method="draft-head", num_speculative_tokens=2, draft_vocab_size=0), "draft_vocab_size"),
])
def test_engine_config_validates_speculative_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("method", ["ngram", "draft-head"])
def test_engine_config_accepts_both_methods(method):
    cfg = EngineConfig(speculative_method=method, num_speculative_tokens=4)
    assert cfg.num_speculative_tokens == 4


def test_draft_head_speculator_reserves_placeholders():
    from tpguide.engine.request import Request, SamplingParams
    from tpguide.speculative.verify import DRAFT_PENDING, Speculator

    spec = Speculator("draft-head", 3, max_model_len=64)
    req = Request("r", 0, SamplingParams(max_tokens=10), prompt_token_ids=[1, 2], output_token_ids=[5])
    assert spec.propose(req, budget=8) == [DRAFT_PENDING] * 3
    assert spec.propose(req, budget=3) == [DRAFT_PENDING] * 2  # the golden token takes one


@pytest.fixture(scope="module")
def spec_decoder(default_model_path):
    from transformers import AutoTokenizer

    from tpguide.guided import make_backend
    from tpguide.guided.spec_decoder import SpeculativeGuidedDecoder

    tok = AutoTokenizer.from_pretrained(default_model_path)
    backend = make_backend("xgrammar", tok, 49152, [2])
    return SpeculativeGuidedDecoder(backend, 49152, 2 * 4), tok


def _ids(tok, text):
    return [tok.convert_tokens_to_ids(ch) for ch in text]


def test_fill_with_drafts_advances_through_accepted_drafts_then_rolls_back(spec_decoder):
    from tpguide.guided import StructuredOutputsParams, unpack_bitmask

    decoder, tok = spec_decoder
    a, b, c, x = _ids(tok, "abcx")
    decoder.add_request(0, StructuredOutputsParams.from_request({"regex": "abcabc"}))
    assert decoder.accept_token(0, a)  # golden token: opens the window
    # drafts b c x: b, c accepted by the grammar, x rejected -> rows 0..2 guided, row 3 not
    bitmask, mask, dead = decoder.fill_bitmask_with_drafts([(0, [b, c, x]), (None, [])])
    assert dead == [] and mask.tolist() == [1, 1, 1, 0, 0]
    allowed = unpack_bitmask(bitmask, 49152)
    assert allowed[0, b] and not allowed[0, c]  # after "a"
    assert allowed[1, c] and allowed[2, a]  # after "ab", after "abc"
    counters = decoder.counters[0]
    assert (counters.num_advanced_tokens, counters.num_advanced_draft_tokens, counters.num_guided_tokens,
            counters.is_draft_terminated) == (3, 2, 3, True)
    assert decoder.rollback_rejected(0, 1) == 1  # target kept "b": roll back "c"
    assert decoder.accept_token(0, c)  # the bonus token, from the state after "ab"
    assert decoder.counters[0].num_advanced_tokens == 1


def test_fill_with_a_stop_token_drafted_clamps_the_accepted_drafts(spec_decoder):
    from tpguide.guided import StructuredOutputsParams

    decoder, tok = spec_decoder
    a, b, c = _ids(tok, "abc")
    decoder.add_request(1, StructuredOutputsParams.from_request({"regex": "abc"}))
    assert decoder.accept_token(1, a)
    bitmask, mask, dead = decoder.fill_bitmask_with_drafts([(1, [b, c, 2, a])])
    assert dead == [] and mask.tolist() == [1, 1, 1, 0, 0]  # row 3 follows the stop token
    counters = decoder.counters[1]
    assert counters.matcher_terminated and counters.num_advanced_tokens == 4
    assert decoder.rollback_rejected(1, 4) == 3  # the target also "accepted" the draft after EOS
    assert decoder.is_terminated(1)


def test_scheduler_drafts_never_starve_a_later_decode():
    from tpguide.engine.request import Request, SamplingParams
    from tpguide.engine.scheduler import Scheduler

    sched = Scheduler(3, 6, propose_drafts=lambda req, budget: [7] * (budget - 1))
    for i in range(3):
        req = Request(f"r{i}", i, SamplingParams(max_tokens=10), prompt_token_ids=[1, 2], output_token_ids=[5])
        req.slot, req.num_computed_tokens = i, 2
        sched.running[i] = req
    seqs = sched.schedule()
    assert [(s.slot, s.num_draft_tokens, len(s.token_ids)) for s in seqs] == [(0, 3, 4), (1, 0, 1), (2, 0, 1)]
    assert seqs[0].token_ids == [5, 7, 7, 7] and seqs[0].start_position == 2
