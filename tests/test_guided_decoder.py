"""GuidedDecoder: slots, reuse, dead ends, matcher errors, threaded fill."""

import pytest
import torch
from guided_testing import load_test_backend

from tpguide.guided import GuidedDecoder, StructuredOutputsParams
from tpguide.guided.matcher import GrammarMatcher, GuidedBackend
from tpguide.guided.slot_record import GuideFailure

PADDED_VOCAB_SIZE = 49280
WORDS = PADDED_VOCAB_SIZE // 32
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
JSON = StructuredOutputsParams(json=SCHEMA)
CHOICE = StructuredOutputsParams(choice=["red", "green"])


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend(request, tokenizer):
    return load_test_backend(request.param, PADDED_VOCAB_SIZE)


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def initial_row(backend, params):
    bitmask = torch.zeros(1, WORDS, dtype=torch.int32)
    backend.matcher(backend.compile(params)).fill_next_token_bitmask(bitmask, 0)
    return bitmask[0]


def test_unguided_rows(backend):
    decoder = GuidedDecoder(backend, PADDED_VOCAB_SIZE, max_num_rows=4)
    decoder.add_request(3, None)
    token_bitmask, token_mask, dead_rows = decoder.fill_bitmask([None, 3, 7])
    assert token_bitmask.shape == (3, WORDS) and token_bitmask.dtype == torch.int32
    assert token_mask.tolist() == [0, 0, 0] and dead_rows == []
    assert (token_bitmask == -1).all()
    assert decoder.accept_token(3, 12345) and not decoder.is_terminated(3)


def test_slot_reuse_resets_state(backend, tokenizer):
    decoder = GuidedDecoder(backend, PADDED_VOCAB_SIZE, max_num_rows=2)
    decoder.add_request(0, JSON)
    for token_id in encode(tokenizer, '{"a": 4'):
        assert decoder.accept_token(0, token_id)
    advanced = decoder.fill_bitmask([0])[0][0].clone()
    assert not torch.equal(advanced, initial_row(backend, JSON))

    decoder.remove_request(0)
    decoder.add_request(0, None)  # an unguided request in the freed slot
    _, token_mask, _ = decoder.fill_bitmask([0, None])
    assert token_mask.tolist() == [0, 0]

    decoder.add_request(0, CHOICE)  # another guided request: its own initial state
    token_bitmask, token_mask, _ = decoder.fill_bitmask([0])
    assert token_mask.tolist() == [1]
    assert torch.equal(token_bitmask[0], initial_row(backend, CHOICE))

    for token_id in encode(tokenizer, "gre"):
        assert decoder.accept_token(0, token_id)
    decoder.add_request(0, JSON)  # replaced without remove: same grammar as before, fresh state
    assert torch.equal(decoder.fill_bitmask([0])[0][0], initial_row(backend, JSON))


def test_terminated_row_allows_only_stop_tokens(backend, tokenizer, stop_ids):
    decoder = GuidedDecoder(backend, PADDED_VOCAB_SIZE, max_num_rows=1)
    decoder.add_request(5, CHOICE)
    for token_id in encode(tokenizer, "red") + [stop_ids[0]]:
        assert decoder.accept_token(5, token_id)
    assert decoder.is_terminated(5)
    token_bitmask, token_mask, dead_rows = decoder.fill_bitmask([5])
    assert torch.equal(token_bitmask[0], backend.stop_bitmask_row)
    assert token_mask.tolist() == [1] and dead_rows == []
    decoder.rollback(5, 1)
    assert not decoder.is_terminated(5)


def test_rejected_token_and_bad_guide(backend, tokenizer):
    decoder = GuidedDecoder(backend, PADDED_VOCAB_SIZE, max_num_rows=2)
    decoder.add_request(1, CHOICE)
    bad_token = encode(tokenizer, "blue")[0]
    assert not decoder.accept_token(1, bad_token)
    assert f"slot 1: grammar rejected token {bad_token}" == decoder.failure_reason(1)
    assert decoder.failure_kind(1) is GuideFailure.REJECTED_TOKEN
    with pytest.raises(ValueError, match=rf"slot 4: {backend.name} cannot compile this regex"):
        decoder.add_request(4, StructuredOutputsParams(regex="(unclosed"))
    assert not decoder.is_guided(4)
    with pytest.raises(ValueError, match="slot 1: cannot roll back 3 tokens: 0 accepted"):
        decoder.rollback(1, 3)
    decoder.remove_request(1)
    assert decoder.failure_reason(1) is None


def test_threaded_fill_matches_sequential(backend, tokenizer):
    prefixes = ['{"a": ', '{"a": 1', "", "gr", '{"', "r"]
    decoders = [
        GuidedDecoder(backend, PADDED_VOCAB_SIZE, max_num_rows=16, num_threads=1),
        GuidedDecoder(backend, PADDED_VOCAB_SIZE, max_num_rows=16, num_threads=2, parallel_threshold=2),
    ]
    for decoder in decoders:
        for slot in range(12):
            prefix = prefixes[slot % len(prefixes)]
            decoder.add_request(slot, JSON if prefix.startswith("{") or prefix == "" else CHOICE)
            for token_id in encode(tokenizer, prefix):
                assert decoder.accept_token(slot, token_id)
    slots = [None] + list(range(12)) + [None]
    results = [decoder.fill_bitmask(slots) for decoder in decoders]
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert results[0][1].tolist() == [0] + [1] * 12 + [0]
    decoders[1].close()


class FakeMatcher(GrammarMatcher):
    """Fills an empty row (a dead end) or raises."""

    def __init__(self, raises):
        self.raises = raises

    def accept_token(self, token_id):
        raise RuntimeError("boom on accept")

    def rollback(self, num_tokens):
        self._check_rollback(num_tokens)

    def fill_next_token_bitmask(self, bitmask, row):
        if self.raises:
            raise RuntimeError("boom on fill")
        bitmask[row] = 0
        bitmask[row, -1] = -(1 << 31)  # only an id beyond padded_vocab_size: still a dead end

    def is_terminated(self):
        return False


class FakeBackend(GuidedBackend):
    name = "fake"
    supported_guide_types = frozenset({"regex"})

    def _compile(self, guide_type, guide_text):
        return guide_text == "raise"

    def matcher(self, compiled):
        return FakeMatcher(compiled)


def test_dead_end_and_matcher_errors_fail_only_their_rows():
    padded = 49157
    decoder = GuidedDecoder(FakeBackend(padded, [0]), padded, max_num_rows=4)
    decoder.add_request(0, StructuredOutputsParams(regex="dead"))
    decoder.add_request(1, StructuredOutputsParams(regex="raise"))
    token_bitmask, token_mask, dead_rows = decoder.fill_bitmask([2, 0, 1])
    assert dead_rows == [1, 2]
    assert token_mask.tolist() == [0, 0, 0]  # dead rows are handed back untouched
    assert (token_bitmask == -1).all()
    assert "slot 0: grammar dead end" in decoder.failure_reason(0) and "49157" in decoder.failure_reason(0)
    assert "slot 1: matcher error while filling the bitmask: boom on fill" == decoder.failure_reason(1)
    assert (decoder.failure_kind(0), decoder.failure_kind(1)) == (GuideFailure.DEAD_END, GuideFailure.MATCHER_ERROR)
    with pytest.raises(ValueError, match="slot 0: matcher error on token 7: boom on accept"):
        decoder.accept_token(0, 7)
    assert decoder.failure_kind(0) is GuideFailure.MATCHER_ERROR
    with pytest.raises(ValueError, match="guide type 'choice' is not supported by the fake backend"):
        decoder.add_request(3, CHOICE)


def test_decoder_argument_errors():
    backend = FakeBackend(64, [0])
    with pytest.raises(ValueError, match="padded_vocab_size=128 != backend.padded_vocab_size=64"):
        GuidedDecoder(backend, 128, 4)
    decoder = GuidedDecoder(backend, 64, 2)
    with pytest.raises(ValueError, match="3 rows requested, max_num_rows=2"):
        decoder.fill_bitmask([None] * 3)
    with pytest.raises(ValueError, match=r"stop_token_ids \[64\] are outside \[0, 64\)"):
        FakeBackend(64, [64])
