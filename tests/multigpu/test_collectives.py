"""Real multi-rank tests of the thin collectives (gloo on CPU)."""

import pytest
import torch

from tpguide.dist import group as C
from tpguide.dist.spawn import run_on_ranks


def _exercise(group):
    r, t = group.tp_rank, group.tp_size
    x = torch.full((3,), float(r + 1))
    summed = C.all_reduce(x.clone(), group).tolist()
    biggest = C.all_reduce(x.clone(), group, op="max").tolist()
    stacked = C.all_gather_stacked(torch.tensor([r, 10 * r]), group).tolist()
    obj = C.broadcast_object({"plan": [1, 2, 3]} if group.is_driver else None, group)
    chunks = [torch.full((2,), 100 + k, dtype=torch.int32) for k in range(t)] if group.is_driver else None
    got = C.scatter_tensor(torch.empty(2, dtype=torch.int32), chunks, group).tolist()
    C.barrier(group)
    return summed, biggest, stacked, obj, got


@pytest.mark.parametrize("tp_size", [2, 3])
def test_collectives_match_definitions(tp_size):
    results = run_on_ranks(_exercise, tp_size)
    total = tp_size * (tp_size + 1) / 2
    for r, (summed, biggest, stacked, obj, got) in enumerate(results):
        assert summed == [total] * 3
        assert biggest == [float(tp_size)] * 3
        assert stacked == [[k, 10 * k] for k in range(tp_size)]
        assert obj == {"plan": [1, 2, 3]}
        assert got == [100 + r, 100 + r]


def test_size_one_is_identity():
    from tpguide.dist import TPGroup

    g = TPGroup()
    x = torch.arange(4.0)
    assert C.all_reduce(x, g) is x
    assert C.all_gather_stacked(x, g).shape == (1, 4)
    assert C.broadcast_object("a", g) == "a"


def _return_tensor(group):
    return torch.full((2,), float(group.tp_rank))


def test_ranks_can_return_tensors():
    assert [t.tolist() for t in run_on_ranks(_return_tensor, 2)] == [[0.0, 0.0], [1.0, 1.0]]
