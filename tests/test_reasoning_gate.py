"""The reasoning gate in one process: parsers, thinking rows, the budget row, </think> inside a verify window."""

import pytest
import torch
from guided_testing import load_test_backend

from tpguide.engine.request import Request, SamplingParams
from tpguide.guided import StructuredOutputsParams, unpack_bitmask
from tpguide.guided.decoder import GuidedDecoder
from tpguide.guided.reasoning import ReasoningParser, resolve_reasoning_parser
from tpguide.guided.thinking import Thinking
from tpguide.speculative.grammar_draft import GrammarDrafter

VOCAB = 49152
END = 49151  # plays </think> (the gate only compares ids)
START = 49150
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
JSON = StructuredOutputsParams.from_request({"json": SCHEMA, "json_whitespace": "compact"})


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend(request, tokenizer):
    return load_test_backend(request.param, VOCAB)


def _grammar_rows(backend, tokenizer, prefixes):
    """The plain grammar rows of JSON after each prefix (no thinking)."""
    decoder = GuidedDecoder(backend, VOCAB, len(prefixes))
    for slot, prefix in enumerate(prefixes):
        decoder.add_request(slot, JSON)
        for token in encode(tokenizer, prefix):
            assert decoder.accept_token(slot, token)
    return decoder.fill_bitmask(list(range(len(prefixes))))[0].clone()


def test_parsers_resolve_split_and_name_the_missing_token(tokenizer):
    assert resolve_reasoning_parser("auto", tokenizer) is None  # the embedded model: nothing changes
    assert resolve_reasoning_parser("none", tokenizer) is None
    for name in ("qwen3", "deepseek_r1"):
        with pytest.raises(ValueError, match="lacks '<think>', '</think>'"):
            resolve_reasoning_parser(name, tokenizer)
    with pytest.raises(ValueError, match="must be one of"):
        resolve_reasoning_parser("qwq", tokenizer)
    parser = ReasoningParser("qwen3", START, END)
    assert parser.starts_thinking([1, 2]) and parser.starts_thinking([1, START, 5])
    assert not parser.starts_thinking([1, START, 5, END, 7])  # enable_thinking false: an empty closed block
    assert parser.starts_thinking([START, END, 3, START])
    assert parser.split([START, 4, 5, END, 6, 7]) == ([4, 5], [6, 7])
    assert parser.split([4, END]) == ([4], [])
    assert parser.split([START, 4, 5]) == ([4, 5], None)  # still thinking (or cut by max_tokens)


def test_thinking_rows_mask_stop_tokens_for_a_guided_request_and_leave_the_matcher(backend, tokenizer):
    decoder = GuidedDecoder(backend, VOCAB, 8)
    decoder.add_request(0, JSON, Thinking(END))
    decoder.add_request(1, None, Thinking(END, budget=2))
    for token in encode(tokenizer, "hmm"):
        assert decoder.accept_token(0, token) and decoder.accept_token(1, token)
    token_bitmask, token_mask, dead = decoder.fill_bitmask([0, 1])
    allowed = unpack_bitmask(token_bitmask, VOCAB)
    stops = sorted(backend.stop_token_ids)
    assert dead == [] and token_mask.tolist() == [1, 1]
    assert not allowed[0, stops].any() and int(allowed[0].sum()) == VOCAB - len(stops) and allowed[0, END]
    assert allowed[1].nonzero().flatten().tolist() == [END]  # budget 2 reached: only </think>
    assert decoder.record(0).matcher.num_accepted_tokens == 0 and not decoder.is_terminated(0)
    assert decoder.record(0).thinking.num_tokens == len(encode(tokenizer, "hmm"))
    assert decoder.accept_token(0, END) and decoder.record(0).answer_start == len(encode(tokenizer, "hmm")) + 1
    token_bitmask, token_mask, _ = decoder.fill_bitmask([0])
    assert token_mask.tolist() == [1] and torch.equal(token_bitmask[0], _grammar_rows(backend, tokenizer, [""])[0])
    for token in encode(tokenizer, '{"ok":true}'):
        assert decoder.accept_token(0, token)
    assert decoder.record(0).matcher.num_accepted_tokens == len(encode(tokenizer, '{"ok":true}'))


def test_an_unguided_thinking_row_is_untouched_until_the_budget(backend, tokenizer):
    decoder = GuidedDecoder(backend, VOCAB, 4)
    decoder.add_request(2, None, Thinking(END, budget=3))
    token_bitmask, token_mask, _ = decoder.fill_bitmask_with_drafts([(2, [7, 8, 9])])
    assert token_mask.tolist() == [0, 0, 0, 1] and (token_bitmask[:3] == -1).all()
    assert unpack_bitmask(token_bitmask, VOCAB)[3].nonzero().flatten().tolist() == [END]


def test_think_end_inside_a_verify_window_masks_the_rows_after_it(backend, tokenizer):
    """Thinking rows up to </think>, the grammar from the row after it, the record unchanged afterwards."""
    decoder = GuidedDecoder(backend, VOCAB, 8)
    decoder.add_request(0, JSON, Thinking(END, budget=3))
    assert decoder.accept_token(0, 11)  # one thinking token verified
    answer = encode(tokenizer, '{"ok":')[:2]
    drafts = [12, 13, END] + answer
    token_bitmask, token_mask, dead = decoder.fill_bitmask_with_drafts([(0, drafts)])
    allowed = unpack_bitmask(token_bitmask, VOCAB)
    assert dead == [] and token_mask.tolist() == [1] * 6
    assert not allowed[0, 2] and allowed[0, 12] and allowed[1, 13]  # thinking: all but the stop tokens
    assert allowed[2].nonzero().flatten().tolist() == [END]  # 3 thinking tokens: the budget row
    plain = _grammar_rows(backend, tokenizer, ["", tokenizer.decode(answer[:1]), tokenizer.decode(answer)])
    assert torch.equal(token_bitmask[3:6], plain[: 3])  # the answer's rows, from </think> on
    record = decoder.record(0)
    assert record.is_thinking and record.thinking.num_tokens == 1 and record.matcher.num_accepted_tokens == 0
    assert decoder.accepted_prefix(0, drafts) == drafts
    assert decoder.accepted_prefix(0, [12, 13, 14]) == [12, 13]  # the budget allows only </think> third
    assert decoder.accepted_prefix(0, [12, 2]) == [12]  # no stop token while a guided request thinks
    assert decoder.accepted_prefix(0, [END] + encode(tokenizer, "x")) == [END]  # the grammar after </think>


def test_the_budget_drafts_think_end_then_the_forced_text(backend, tokenizer):
    decoder = GuidedDecoder(backend, VOCAB, 8)
    drafter = GrammarDrafter(tokenizer, VOCAB)
    req = Request("r", 0, SamplingParams(max_tokens=20, thinking_token_budget=1), prompt_token_ids=[1])
    req.slot, req.structured_output = 0, JSON
    decoder.add_request(0, JSON, Thinking(END, budget=1))
    assert drafter.propose(decoder, 0, 4, req) == []  # thinking, under budget: nothing is forced
    assert decoder.accept_token(0, 11)
    req.output_token_ids = [11]
    drafts = drafter.propose(decoder, 0, 4, req)
    plain = GuidedDecoder(backend, VOCAB, 8)
    plain.add_request(0, JSON)
    fresh = Request("p", 1, SamplingParams(max_tokens=20), prompt_token_ids=[1])
    fresh.slot, fresh.structured_output = 0, JSON
    assert drafts[0] == END and drafts[1:] == drafter.propose(plain, 0, 3, fresh) != []  # the answer's forced text
    assert decoder.record(0).is_thinking and decoder.record(0).matcher.num_accepted_tokens == 0
    unguided = GuidedDecoder(backend, VOCAB, 8)
    unguided.add_request(1, None, Thinking(END, budget=0))
    req.slot, req.structured_output, req.output_token_ids = 1, None, []
    assert drafter.propose(unguided, 1, 4, req) == [END]
