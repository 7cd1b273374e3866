"""Grammar drafts in one process: forced strings of both backends, the drafter, the speculator's composition, flags."""

import dataclasses

import pytest
import torch
from cli_config import engine_config
from guided_testing import load_test_backend

from tpguide.engine.drafting import draft_input_of
from tpguide.engine.request import Request, SamplingParams
from tpguide.guided import StructuredOutputsParams, make_backend, token_ids_to_bitmask_row
from tpguide.guided.admission import admit
from tpguide.guided.bitmask import single_allowed_token
from tpguide.guided.decoder import GuidedDecoder
from tpguide.guided.llguidance_backend import complete_utf8_prefix
from tpguide.speculative.grammar_draft import GrammarDrafter, strict_prefix_token_ids
from tpguide.speculative.propose import DRAFT_PENDING, Speculator

VOCAB = 49152
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
BACKENDS = ["xgrammar", "llguidance"]


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def drafter(tokenizer):
    return GrammarDrafter(tokenizer, VOCAB)


def _decoder(backend_name, slot, params, tokenizer, prefix=""):
    decoder = GuidedDecoder(load_test_backend(backend_name, VOCAB), VOCAB, 4 * 5)
    decoder.add_request(slot, StructuredOutputsParams.from_request(params))
    for token in encode(tokenizer, prefix):
        assert decoder.accept_token(slot, token)
    return decoder


@pytest.mark.parametrize("name", BACKENDS)
def test_both_backends_report_the_forced_string(name, tokenizer):
    decoder = _decoder(name, 0, {"json": SCHEMA}, tokenizer, '{"')
    matcher = decoder.record(0).matcher
    assert matcher.find_jump_forward_string() == 'name"'  # then whitespace may follow: not forced
    for token in encode(tokenizer, 'name": "Al", "'):
        assert matcher.accept_token(token)
    assert matcher.find_jump_forward_string() == 'age"'
    assert matcher.accept_token(encode(tokenizer, "age")[0])
    assert matcher.find_jump_forward_string() == '"'


def test_forced_bytes_are_cut_to_whole_characters():
    assert complete_utf8_prefix("abé".encode()) == "abé"
    assert complete_utf8_prefix("abé".encode()[:-1]) == "ab"  # ends inside é
    assert complete_utf8_prefix("é".encode()[1:] + b"x") == ""  # starts inside é
    assert complete_utf8_prefix(b"") == ""


def test_single_allowed_token():
    assert single_allowed_token(token_ids_to_bitmask_row([37], 128), 128) == 37
    assert single_allowed_token(token_ids_to_bitmask_row([31], 64), 64) == 31  # the sign bit of word 0
    assert single_allowed_token(token_ids_to_bitmask_row([3, 40], 64), 64) is None
    assert single_allowed_token(token_ids_to_bitmask_row([3, 4], 64), 64) is None
    assert single_allowed_token(torch.zeros(2, dtype=torch.int32), 64) is None
    assert single_allowed_token(token_ids_to_bitmask_row([62], 64), 60) is None  # an id >= vocab_size
    rows = torch.stack([token_ids_to_bitmask_row([3, 4], 96), token_ids_to_bitmask_row([70], 96)])
    token = single_allowed_token(rows[1], 96)  # a row of a bitmask, as the drafter passes it
    assert token == 70 and type(token) is int


@pytest.mark.parametrize("name", BACKENDS)
def test_drafts_are_the_canonical_tokens_of_the_forced_text(name, tokenizer, drafter):
    decoder = _decoder(name, 1, {"json": SCHEMA}, tokenizer, '{"name": "Al", "')
    before = decoder.record(1).matcher.num_accepted_tokens
    # 'age"': the tokens of "age", and '"' dropped: the model merges it with what follows ('":')
    assert drafter.propose(decoder, 1, 4) == encode(tokenizer, "age")
    assert drafter.propose(decoder, 1, 0) == []
    assert decoder.record(1).matcher.num_accepted_tokens == before  # rolled back at once
    choice = _decoder(name, 2, {"choice": ["the quick brown fox jumps"]}, tokenizer)
    full = encode(tokenizer, "the quick brown fox jumps")
    assert drafter.propose(choice, 2, 3) == full[:3]  # cut at K, nothing dropped


def test_the_walk_drafts_a_lone_allowed_token(tokenizer, drafter):
    """No forced text, one allowed token: with a single stop id, the end of a grammar forces the stop token."""
    backend = make_backend("xgrammar", tokenizer, VOCAB, [2])
    decoder = GuidedDecoder(backend, VOCAB, 8)
    decoder.add_request(0, StructuredOutputsParams.from_request({"regex": "ab"}))
    a, b = encode(tokenizer, "a")[0], encode(tokenizer, "b")[0]
    assert decoder.accept_token(0, a)
    assert drafter.propose(decoder, 0, 4) == [b, 2]  # the forced "b", then the walk: the stop token, then nothing
    assert not decoder.is_terminated(0) and decoder.record(0).matcher.num_accepted_tokens == 1


def test_strict_prefix_ids_compare_token_strings():
    class Vocab:
        all_special_ids = [9]

        def get_vocab(self):
            return {"a": 0, "ab": 1, "abc": 2, "b": 3, "<s>": 9, "<s>x": 4}

    assert strict_prefix_token_ids(Vocab()) == frozenset({0, 1})  # "<s>" is special: not counted


def _request(slot, structured=True, **sampling):
    req = Request("r", 0, SamplingParams(max_tokens=20, **sampling), prompt_token_ids=[1, 2], output_token_ids=[5])
    req.slot = slot
    if structured:
        req.structured_output = StructuredOutputsParams.from_request({"json": SCHEMA})
    return draft_input_of(req)


class FixedNgram:
    def __init__(self, drafts):
        self.drafts = drafts

    def propose(self, token_ids, k):
        return self.drafts[:k]


@pytest.mark.parametrize("method", ["grammar", "ngram", "draft-head"])
def test_forced_text_first_then_the_fallback(method, tokenizer, drafter):
    decoder = _decoder("xgrammar", 0, {"json": SCHEMA}, tokenizer, '{"')
    free = _decoder("xgrammar", 1, {"json": SCHEMA}, tokenizer, '{"name": "A')  # nothing forced
    spec = Speculator(method, 4, 128, grammar_drafter=drafter)
    if method == "ngram":
        spec.proposer = FixedNgram(encode(tokenizer, 'l", "age": 4, "x'))
    name = encode(tokenizer, "name")
    assert spec.propose(_request(0), 8, decoder) == name
    assert spec.verify(name, name + [7], 0, forced=decoder.record(0).forced).num_accepted == len(name)
    assert (spec.stats.num_forced_drafted, spec.stats.num_forced_accepted) == (len(name), len(name))
    fallback = spec.propose(_request(1), 8, free)
    if method == "grammar":
        assert fallback == []
    elif method == "draft-head":
        assert fallback == [DRAFT_PENDING] * 4
    else:
        assert fallback == encode(tokenizer, 'l", "age": 4, "x')[:4]
    spec.verify(fallback[:1], [0, 0], 0, forced=free.record(1).forced)
    assert spec.stats.num_forced_drafted == len(name)  # the fallback's draft is not forced text
    assert spec.stats.num_drafted == len(name) + len(fallback[:1])
    # penalties: no grammar drafts (the rows would need the drafts in the request's history); the n-gram
    # drafts 'l", ...' are no property name of the schema, so the grammar cuts them to nothing
    penalized = spec.propose(_request(0, presence_penalty=0.5), 8, decoder)
    assert penalized == ([DRAFT_PENDING] * 4 if method == "draft-head" else [])


def test_ngram_drafts_of_a_guided_request_stop_where_the_grammar_rejects(tokenizer):
    decoder = _decoder("xgrammar", 0, {"json": SCHEMA}, tokenizer, '{"name": "A')
    spec = Speculator("ngram", 4, 128)
    drafts = [encode(tokenizer, text)[0] for text in ("l", '"', "}", "x")]
    spec.proposer = FixedNgram(drafts)
    assert spec.propose(_request(0), 8, decoder) == drafts[:2]  # "}" before the required "age": rejected
    assert spec.propose(_request(0, structured=False), 8) == spec.proposer.drafts[:4]  # unguided: untouched


@pytest.mark.parametrize("method", ["grammar", "ngram"])
def test_drafts_of_a_smaller_budget_are_a_prefix(method, tokenizer, drafter):
    """The drafting phase proposes with the whole budget and the scheduler cuts (docs/architecture.md §1):
    that equals a proposal with the smaller budget only because of this prefix property."""
    decoder = _decoder("xgrammar", 0, {"regex": "the quick brown fox jumps over the lazy dog"}, tokenizer, "the")
    spec = Speculator(method, 8, 128, grammar_drafter=drafter)
    seq = _request(0)
    seq = dataclasses.replace(seq, output_token_ids=encode(tokenizer, "the quick the quick the"))
    full = spec.propose(seq, 9, decoder)
    assert len(full) >= 6  # forced text all the way (its last token dropped where a longer one extends it)
    for budget in range(1, 9):
        assert spec.propose(seq, budget, decoder) == full[:budget - 1], budget
    free = spec.propose(dataclasses.replace(seq, structured_output=None), 9)  # unguided: n-gram or nothing
    for budget in range(1, 9):
        assert spec.propose(dataclasses.replace(seq, structured_output=None), budget) == free[:budget - 1]


@pytest.mark.parametrize("argv, method, grammar, k", [
    ((), "grammar", True, 4),
    (("--speculative-method", "ngram"), "ngram", True, 4),
    (("--speculative-method", "ngram", "--no-grammar-draft", "--num-speculative-tokens", "2"), "ngram", False, 2),
    (("--no-grammar-draft",), None, False, 0),
    (("--speculative-method", "none"), None, True, 0),
])
def test_flags_compose_grammar_drafts_with_the_method(argv, method, grammar, k):
    config = engine_config(*argv)
    assert (config.speculative_method, config.num_speculative_tokens) == (method, k)
    assert config.grammar_draft == grammar


def test_flags_refuse_k_without_drafts():
    with pytest.raises(ValueError, match="needs drafts"):
        engine_config("--speculative-method", "none", "--num-speculative-tokens", "3")


def _layout_request(slot, text, tokenizer, whitespace=None):
    guide = {"json": SCHEMA} if whitespace is None else {"json": SCHEMA, "json_whitespace": whitespace}
    req = Request("r", 0, SamplingParams(max_tokens=40), prompt_token_ids=[1, 2],
                  output_token_ids=encode(tokenizer, text))
    req.slot, req.structured_output = slot, StructuredOutputsParams.from_request(guide)
    return req


@pytest.mark.parametrize("name", BACKENDS)  # llguidance: the drafter's own xgrammar backend compiles the layouts
@pytest.mark.parametrize("text, layout_text", [
    ('{\n  "name": "Al",\n', '  "age": '),  # json.dumps(indent=2): the other layouts dropped out at "\n"
    ('{"name": "Al", ', '"age": '),  # one line, ", " and ": "
    ('{\n    "name": "Al",\n', '    "age": '),  # indent 4
])
def test_layouts_draft_the_whitespace_the_output_has_kept(name, text, layout_text, tokenizer):
    """Bounded whitespace forces nothing after a comma; the layout still in the race drafts its spacing and name."""
    drafter = GrammarDrafter(tokenizer, VOCAB)
    decoder = _decoder(name, 0, {"json": SCHEMA}, tokenizer, text)
    assert decoder.record(0).matcher.find_jump_forward_string() == ""  # the guide itself forces nothing here
    assert drafter.propose(decoder, 0, 8) == []  # without the request: forced text only
    req = _layout_request(0, text, tokenizer)
    drafter.prepare(decoder.backend, req.structured_output)
    drafts = drafter.propose(decoder, 0, 8, req)
    assert drafts == drafter.draft_tokens(layout_text, 8) and drafts
    assert decoder.record(0).matcher.num_accepted_tokens == len(req.output_token_ids)  # rolled back
    # the output leaves the layout: a second newline after the comma is no json.dumps layout
    req.output_token_ids = req.output_token_ids + encode(tokenizer, "\n")
    assert decoder.accept_token(0, req.output_token_ids[-1])
    assert drafter.propose(decoder, 0, 8, req) == []


def test_layouts_are_compiled_with_the_guide_and_skipped_where_the_guide_forces_all(tokenizer):
    """``prepare`` fills the backend cache (the compile thread); compact guides and other guide types get no layouts."""
    backend = make_backend("auto", tokenizer, VOCAB, [2])
    drafter = GrammarDrafter(tokenizer, VOCAB)
    params = StructuredOutputsParams.from_request({"json": SCHEMA})
    xgrammar = backend.backends["xgrammar"]
    decoder = GuidedDecoder(backend, VOCAB, 8)
    decoder.add_request(1, params, compiled=admit(backend, params)[1])  # as the engine: the admitted guide
    guides = len(xgrammar._cache)
    text = '{\n  "name": "Al",\n'
    for token in encode(tokenizer, text):
        assert decoder.accept_token(1, token)
    assert drafter.propose(decoder, 1, 8, _layout_request(1, text, tokenizer)) == []  # a step never compiles
    drafter.prepare(backend, params)
    decoder.add_request(1, params)  # the next request in the slot: a fresh record, with the compiled layouts
    for token in encode(tokenizer, text):
        assert decoder.accept_token(1, token)
    assert drafter.propose(decoder, 1, 8, _layout_request(1, text, tokenizer)) == drafter.draft_tokens('  "age": ', 8)
    layouts = drafter.layout_compiler(backend)
    assert len(layouts) == 4 and len(xgrammar._cache) == guides  # one per json.dumps layout, apart from the guides
    drafter.prepare(backend, params)
    assert len(layouts) == 4  # cached
    for guide in ({"json": SCHEMA, "json_whitespace": "compact"}, {"regex": "[ab]+"}):
        drafter.prepare(backend, StructuredOutputsParams.from_request(guide))
    assert len(layouts) == 4
    assert all(layouts.cached(params, layout) is not None for layout in ("indent2", "compact"))
    with pytest.raises(ValueError, match="no 'indent9' JSON layout"):
        layouts.compile(params, "indent9")
    compact = StructuredOutputsParams.from_request({"json": SCHEMA, "json_whitespace": "compact"})
    decoder.add_request(0, compact, compiled=admit(backend, compact)[1])
    req = _layout_request(0, "", tokenizer, whitespace="compact")
    assert drafter.propose(decoder, 0, 8, req) == drafter.draft_tokens('{"name":"', 8)  # the guide's own text
