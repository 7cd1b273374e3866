"""Continuous batching: token budget, chunked prefill, slot reuse."""

import pytest

from tpguide.engine.request import Request, SamplingParams
from tpguide.engine.scheduler import Scheduler


def _req(i, prompt_len):
    r = Request(request_id=str(i), index=i, sampling_params=SamplingParams(max_tokens=4))
    r.prompt_token_ids = list(range(100, 100 + prompt_len))
    return r


def _advance(scheduled, token=7):
    """What the driver does after a step: count computed tokens, append samples."""
    for s in scheduled:
        s.request.num_computed_tokens += len(s.token_ids)
        if s.samples:
            s.request.output_token_ids.append(token)


def test_long_prompt_is_prefilled_in_chunks_within_the_budget():
    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=4)
    a = _req(0, 10)
    sched.add(a)
    chunks = []
    while a.is_prefill:
        step = sched.schedule()
        assert sum(len(s.token_ids) for s in step) <= 4
        chunks.append([(s.start_position, len(s.token_ids), s.samples) for s in step])
        _advance(step)
    assert chunks == [[(0, 4, False)], [(4, 4, False)], [(8, 2, True)]]
    step = sched.schedule()
    assert [(s.start_position, s.token_ids, s.is_prefill) for s in step] == [(10, [7], False)]


def test_decode_goes_first_and_new_requests_fill_the_rest_of_the_budget():
    sched = Scheduler(max_num_seqs=3, max_num_batched_tokens=6)
    a, b, c = _req(0, 3), _req(1, 5), _req(2, 2)
    for r in (a, b, c):
        sched.add(r)
    step = sched.schedule()
    # a takes 3, b gets the remaining 3 of its 5; c waits for budget
    assert [(s.request.index, len(s.token_ids)) for s in step] == [(0, 3), (1, 3)]
    _advance(step)
    step = sched.schedule()
    # a decodes first (1), b finishes its prompt (2), c is admitted (2)
    assert [(s.request.index, len(s.token_ids), s.is_prefill) for s in step] == [
        (0, 1, False), (1, 2, True), (2, 2, True)]


def test_a_freed_slot_is_reused_and_starts_at_position_zero():
    sched = Scheduler(max_num_seqs=1, max_num_batched_tokens=16)
    a, b = _req(0, 3), _req(1, 4)
    sched.add(a)
    sched.add(b)
    step = sched.schedule()
    assert [s.request.index for s in step] == [0]
    _advance(step)
    a.finish("stop")
    sched.release(a)
    step = sched.schedule()
    assert [(s.request.index, s.slot, s.start_position, len(s.token_ids)) for s in step] == [(1, a.slot, 0, 4)]
    assert not sched.waiting


def test_bad_limits_are_rejected():
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(0, 8)
