"""Table-driven tests of prepare_sampler_inputs (docs/architecture.md §4)."""

import pytest

from tpguide.sampling.sampler_inputs import ScheduledSeq, prepare_sampler_inputs


def prefill(q, nc, prompt_len, logprobs=False, exclude=False):
    return ScheduledSeq(
        query_len=q,
        num_computed_tokens=nc,
        prompt_len=prompt_len,
        is_prefill=True,
        is_last_prefill_chunk=nc + q == prompt_len,
        want_prompt_logprobs=logprobs,
        exclude=exclude,
    )


def decode(nc, prompt_len, drafts=0):
    return ScheduledSeq(
        query_len=1 + drafts, num_computed_tokens=nc, prompt_len=prompt_len, is_prefill=False,
        num_draft_tokens=drafts,
    )


# (name, seqs, selected_token_indices, sample_positions, sample_row_offsets,
#  selected_prompt_indices, prompt_target_positions, prompt_row_offsets)
CASES = [
    (
        "deepinfer: prefill A=6, B=3 tokens",
        [prefill(6, 0, 6), prefill(3, 0, 3)],
        [5, 8], [6, 3], [0, 1, 2], [], [], [0, 0, 0],
    ),
    (
        "deepinfer: A with prompt logprobs, B without",
        [prefill(6, 0, 6, logprobs=True), prefill(3, 0, 3)],
        [5, 8], [6, 3], [0, 1, 2], [0, 1, 2, 3, 4], [1, 2, 3, 4, 5], [0, 5, 5],
    ),
    (
        "deepinfer: first chunk of 4 of a 10-token prompt",
        [prefill(4, 0, 10, logprobs=True)],
        [3], [4], [0, 1], [0, 1, 2, 3], [1, 2, 3, 4], [0, 4],
    ),
    (
        "deepinfer: three-sequence walk (A last chunk, B whole, C middle chunk)",
        [prefill(5, 7, 12, logprobs=True), prefill(3, 0, 3), prefill(4, 5, 20, logprobs=True)],
        [4, 7, 11], [12, 3, 9], [0, 1, 2, 3],
        [0, 1, 2, 3, 8, 9, 10, 11], [8, 9, 10, 11, 6, 7, 8, 9], [0, 4, 4, 8],
    ),
    (
        "deepinfer: decode, one row each (s_k = 17, 5)",
        [decode(16, 4), decode(4, 4)],
        [0, 1], [17, 5], [0, 1, 2], [], [], [0, 0, 0],
    ),
    (
        "deepinfer: decode, A with 2 drafts, B with 1 (s_k = 12, 8)",
        [decode(9, 3, drafts=2), decode(6, 6, drafts=1)],
        [0, 1, 2, 3, 4], [10, 11, 12, 7, 8], [0, 3, 5], [], [], [0, 0, 0],
    ),
    (
        "mixed: decode, prefill chunk, decode with drafts",
        [decode(9, 5), prefill(4, 2, 6), decode(20, 10, drafts=3)],
        [0, 4, 5, 6, 7, 8], [10, 6, 21, 22, 23, 24], [0, 1, 2, 6], [], [], [0, 0, 0, 0],
    ),
    (
        "non-final chunk excluded: no sample row, prompt rows kept",
        [prefill(4, 0, 10, logprobs=True, exclude=True), prefill(2, 0, 2)],
        [5], [2], [0, 0, 1], [0, 1, 2, 3], [1, 2, 3, 4], [0, 4, 4],
    ),
    (
        "prompt logprobs on a decode step contribute nothing",
        [ScheduledSeq(1, 7, 7, is_prefill=False, want_prompt_logprobs=True)],
        [0], [8], [0, 1], [], [], [0, 0],
    ),
    ("empty batch", [], [], [], [0], [], [], [0]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_table(case):
    _, seqs, sel, pos, sro, psel, ptgt, pro = case
    out = prepare_sampler_inputs(seqs)
    assert out.selected_token_indices.tolist() == sel
    assert out.sample_positions.tolist() == pos
    assert out.sample_row_offsets.tolist() == sro
    assert out.selected_prompt_indices.tolist() == psel
    assert out.prompt_target_positions.tolist() == ptgt
    assert out.prompt_row_offsets.tolist() == pro
    # derived invariants
    import torch

    for t in vars(out).values():
        assert t.dtype == torch.int32
    assert out.num_tokens == sum(s.query_len for s in seqs)
    assert out.num_sample_rows == len(sel) and out.num_prompt_rows == len(psel)
    starts = out.query_start_loc.tolist()
    for i in range(len(seqs)):
        lo, hi = sro[i], sro[i + 1]
        assert out.sample_row_to_seq[lo:hi].tolist() == [i] * (hi - lo)
        # every selected row belongs to its own sequence
        assert all(starts[i] <= r < starts[i + 1] for r in sel[lo:hi])
        assert all(starts[i] <= r < starts[i + 1] for r in psel[pro[i]:pro[i + 1]])


@pytest.mark.parametrize("chunks", [[4, 4, 2], [10], [1] * 10, [9, 1], [1, 9], [3, 3, 3, 1]])
def test_chunked_prompt_logprobs_total_len_minus_one(chunks):
    """Across the chunks of one prompt the prompt rows target positions 1..L-1 exactly once."""
    prompt_len = sum(chunks)
    targets, nc = [], 0
    for q in chunks:
        out = prepare_sampler_inputs([prefill(q, nc, prompt_len, logprobs=True)])
        assert out.num_prompt_rows == (q - 1 if nc + q == prompt_len else q)
        assert out.selected_token_indices.tolist() == [q - 1]
        targets += out.prompt_target_positions.tolist()
        nc += q
    assert targets == list(range(1, prompt_len))


def test_drafts_replay_positions_of_plain_decode():
    """A decode with k drafts samples at the positions k+1 plain decode steps would use."""
    with_drafts = prepare_sampler_inputs([decode(10, 4, drafts=3)]).sample_positions.tolist()
    plain = [prepare_sampler_inputs([decode(10 + j, 4)]).sample_positions.item() for j in range(4)]
    assert with_drafts == plain == [11, 12, 13, 14]


BAD = [
    ("query_len must be >= 1, got 0", dict(query_len=0, num_computed_tokens=0, prompt_len=4, is_prefill=True)),
    ("must be >= 0", dict(query_len=1, num_computed_tokens=-1, prompt_len=4, is_prefill=True)),
    ("must be >= 0", dict(query_len=1, num_computed_tokens=4, prompt_len=4, is_prefill=False, num_draft_tokens=-1)),
    ("prompt_len must be >= 1, got 0", dict(query_len=1, num_computed_tokens=0, prompt_len=0, is_prefill=True)),
    ("cannot carry draft tokens", dict(query_len=3, num_computed_tokens=0, prompt_len=3, is_prefill=True,
                                       is_last_prefill_chunk=True, num_draft_tokens=2)),
    ("runs past the prompt: 2 + 3 > 4", dict(query_len=3, num_computed_tokens=2, prompt_len=4, is_prefill=True)),
    ("is_last_prefill_chunk=False", dict(query_len=4, num_computed_tokens=0, prompt_len=4, is_prefill=True)),
    ("is_last_prefill_chunk=True", dict(query_len=2, num_computed_tokens=0, prompt_len=4, is_prefill=True,
                                        is_last_prefill_chunk=True)),
    ("last prefill chunk cannot be excluded", dict(query_len=4, num_computed_tokens=0, prompt_len=4,
                                                   is_prefill=True, is_last_prefill_chunk=True, exclude=True)),
    ("query_len == 1 + num_draft_tokens, got 3 != 1 + 1", dict(query_len=3, num_computed_tokens=5, prompt_len=4,
                                                              is_prefill=False, num_draft_tokens=1)),
    ("num_computed_tokens=2 < prompt_len=4", dict(query_len=1, num_computed_tokens=2, prompt_len=4, is_prefill=False)),
    ("decode step cannot set", dict(query_len=1, num_computed_tokens=4, prompt_len=4, is_prefill=False, exclude=True)),
]


@pytest.mark.parametrize("match,kwargs", BAD, ids=[b[0] for b in BAD])
def test_bad_metadata_raises(match, kwargs):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace("+", r"\+")):
        ScheduledSeq(**kwargs)


def test_bad_element_type_and_overflow():
    with pytest.raises(TypeError, match=r"seqs\[1\] must be a ScheduledSeq, got dict"):
        prepare_sampler_inputs([prefill(1, 0, 1), {"query_len": 1}])
    with pytest.raises(ValueError, match="overflows int32"):
        prepare_sampler_inputs([decode(2**31 - 1, 4)])
