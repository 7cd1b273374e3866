"""The persistent step buffers hold what the per-step builders give, and padding only adds rows (docs/gpu.md)."""

import pytest
import torch

from tpguide.model.attention import AttentionMetadata
from tpguide.sampling.sampler import SamplingMetadata
from tpguide.worker.cuda_graphs import (
    BUCKETS,
    MAX_GRAPH_TOKENS,
    bucket_for,
    capture_buckets,
    graph_buckets,
    graphs_supported,
)
from tpguide.worker.protocol import StepPlan
from tpguide.worker.step_inputs import BitmaskBuffers, StepBuffers, StepCapacity

BLOCK = 4
CAPACITY = StepCapacity(max_tokens=32, max_seqs=4, max_blocks_per_seq=6, block_size=BLOCK)


def _plan(query_lens=(5, 1, 3), context_lens=(2, 9, 4), tables=((7, 2), (0, 3, 5), (1, 4)),
          selected=(6, 7, 8, 9)) -> StepPlan:
    """A mixed step: a prefill chunk (one sample row), a decode token, a verify window of three rows."""
    rows = len(selected)
    sampling = SamplingMetadata(temperature=torch.tensor([0.0, 0.7, 1.0, 0.5][:rows]),
                                top_k=torch.tensor([0, 5, -1, 3][:rows], dtype=torch.int32),
                                top_p=torch.tensor([1.0, 0.9, 1.0, 0.5][:rows]),
                                seeds=torch.tensor([3, 4, 5, 6][:rows]),
                                sample_positions=torch.tensor([6, 9, 4, 5][:rows]))
    num_tokens = sum(query_lens)
    return StepPlan(input_ids=torch.arange(100, 100 + num_tokens), block_tables=[list(t) for t in tables],
                    query_lens=list(query_lens), context_lens=list(context_lens),
                    selected_token_indices=torch.tensor(selected, dtype=torch.int32), sampling=sampling)


def test_unpadded_views_equal_the_per_step_metadata():
    plan = _plan()
    got = StepBuffers(CAPACITY, torch.device("cpu")).stage(plan)
    want = AttentionMetadata.from_block_tables(plan.block_tables, plan.query_lens, plan.context_lens,
                                               block_size=BLOCK)
    for name in ("block_tables", "query_start_loc", "context_lens", "query_lens", "seq_lens", "token_seq_index",
                 "token_query_index", "token_positions"):
        assert torch.equal(getattr(got.meta, name), getattr(want, name)), name
    assert (got.meta.max_query_len, got.meta.max_seq_len) == (want.max_query_len, want.max_seq_len)
    assert torch.equal(got.meta.slot_mapping(BLOCK), want.slot_mapping(BLOCK))
    assert torch.equal(got.input_ids, plan.input_ids)
    assert torch.equal(got.positions, want.token_positions)
    assert torch.equal(got.selected, plan.selected_token_indices.long())
    for name in ("temperature", "top_k", "top_p", "seeds", "sample_positions"):
        assert torch.equal(getattr(got.sampling, name).to(getattr(plan.sampling, name).dtype),
                           getattr(plan.sampling, name)), name


def test_padded_views_keep_the_rows_and_add_padding():
    plan = _plan()
    buffers = StepBuffers(CAPACITY, torch.device("cpu"))
    unpadded = buffers.stage(plan)
    unpadded = {k: v.clone() for k, v in (("ids", unpadded.input_ids), ("pos", unpadded.positions),
                                          ("slot", unpadded.meta.slot_mapping(BLOCK)), ("sel", unpadded.selected),
                                          ("seq", unpadded.meta.token_seq_index))}
    got = buffers.stage(plan, num_padded_tokens=16)
    t, r = plan.input_ids.numel(), plan.selected_token_indices.numel()
    assert got.input_ids.numel() == got.meta.num_tokens == 16 and got.meta.num_seqs == CAPACITY.max_seqs
    assert torch.equal(got.input_ids[:t], unpadded["ids"]) and not got.input_ids[t:].any()
    assert torch.equal(got.positions[:t], unpadded["pos"]) and (got.positions[t:] == -1).all()
    assert torch.equal(got.meta.slot_mapping(BLOCK)[:t], unpadded["slot"])
    assert (got.meta.slot_mapping(BLOCK)[t:] == -1).all()
    assert torch.equal(got.meta.token_seq_index[:t], unpadded["seq"])
    assert torch.equal(got.selected[:r], unpadded["sel"]) and (got.selected[r:] == 15).all()  # a padding token
    assert got.meta.query_lens.tolist() == plan.query_lens + [0] and got.meta.query_start_loc[-1] == t
    assert got.sampling.num_rows == r


def test_a_step_that_fills_its_bucket_points_padded_rows_at_a_real_token():
    plan = _plan(query_lens=(4,), context_lens=(0,), tables=((3,),), selected=(3,))
    got = StepBuffers(CAPACITY, torch.device("cpu")).stage(plan, num_padded_tokens=4)
    assert got.selected.tolist() == [3, 0, 0, 0]


def test_padding_only_step_writes_and_reads_nothing():
    got = StepBuffers(CAPACITY, torch.device("cpu")).stage_padding(8)
    assert (got.positions == -1).all() and (got.meta.slot_mapping(BLOCK) == -1).all()
    assert got.input_ids.numel() == 8 and not got.input_ids.any()


@pytest.mark.parametrize("bad", [dict(num_padded_tokens=5), dict(num_padded_tokens=64)])
def test_a_step_that_does_not_fit_is_refused(bad):
    with pytest.raises(ValueError, match="does not fit"):
        StepBuffers(CAPACITY, torch.device("cpu")).stage(_plan(), **bad)


def test_a_short_block_table_is_refused():
    with pytest.raises(ValueError, match="sequence 1: block table of 2 blocks x 4 tokens cannot hold 10 positions"):
        StepBuffers(CAPACITY, torch.device("cpu")).stage(_plan(tables=((7, 2), (0, 3), (1, 4))))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_bitmask_buffers_carry_mask_and_slices(tp_size):
    words, rows = 8, 3
    buffers = BitmaskBuffers(max_rows=5, bitmask_size=words, tp_size=tp_size, device=torch.device("cpu"))
    full = torch.arange(rows * words, dtype=torch.int32).view(rows, words) - 7
    slices = list(full.split(words // tp_size, dim=1))
    token_mask, sent = buffers.send(torch.tensor([1, 0, 1], dtype=torch.int32), slices)
    assert token_mask.tolist() == [1, 0, 1]
    assert all(torch.equal(a, b) for a, b in zip(sent, slices, strict=True))
    mask_view, local = buffers.receive_views(rows)
    assert torch.equal(local, slices[0]) and torch.equal(mask_view, token_mask)
    with pytest.raises(ValueError, match="does not fit"):
        buffers.send(torch.ones(6, dtype=torch.int32), [torch.zeros(6, words // tp_size, dtype=torch.int32)] * tp_size)


def test_buckets():
    assert graph_buckets(40) == (1, 2, 4, 8, 16, 24, 32)
    assert bucket_for(5, graph_buckets(40)) == 8 and bucket_for(33, graph_buckets(40)) is None
    assert all(a < b for a, b in zip(BUCKETS, BUCKETS[1:]))


def test_graphs_are_captured_up_to_the_largest_decode_step():
    from tpguide.engine import EngineConfig, step_capacity

    cap = step_capacity(EngineConfig(max_num_seqs=16))  # 16 rows x (1 + 4 drafts) = 80 tokens: bucket 96
    assert cap.max_graph_tokens == 80 and capture_buckets(cap)[-1] == 96
    assert capture_buckets(step_capacity(EngineConfig(max_num_seqs=16, speculative_method=None)))[-1] == 16
    assert capture_buckets(step_capacity(EngineConfig(max_num_seqs=256)))[-1] == MAX_GRAPH_TOKENS  # vLLM's cap
    assert capture_buckets(StepCapacity(40, 4, 4, BLOCK)) == graph_buckets(40)  # no decode bound: the buffers'
    assert capture_buckets(StepCapacity(40, 4, 4, BLOCK, max_graph_tokens=100)) == graph_buckets(40)


def test_no_graphs_on_cpu():
    from tpguide.dist import TPGroup

    supported, why = graphs_supported(None, TPGroup())
    assert not supported and "not CUDA" in why
