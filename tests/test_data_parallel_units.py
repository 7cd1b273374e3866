"""Data-parallel arithmetic in one process: the replica layout, the sizes flags, the offline split."""

from __future__ import annotations

import pytest

from tpguide.dist.group import init_tp_group
from tpguide.dist.replicas import ReplicaLayout, describe_replica, layout_from_sizes
from tpguide.engine.data_parallel import assign_to_replicas, request_cost
from tpguide.engine.request_io import request_from_dict


def test_layout_ranks_and_drivers():
    lay = ReplicaLayout(world_size=6, dp_size=3)
    assert lay.tp_size == 2
    assert [(lay.dp_rank_of(r), lay.tp_rank_of(r)) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0),
                                                                         (2, 1)]
    assert lay.ranks_of(2) == [4, 5] and lay.driver_rank(1) == 2
    assert describe_replica(1, 2) == "replica 1 (global ranks 2-3)"
    assert describe_replica(1, 1) == "replica 1 (global rank 1)"


def test_sizes_flags():
    assert layout_from_sizes(4, None, None) == ReplicaLayout(4, 1)
    assert layout_from_sizes(4, 2, None).tp_size == 2
    assert layout_from_sizes(4, None, 1) == ReplicaLayout(4, 4)
    assert layout_from_sizes(4, 2, 2) == ReplicaLayout(4, 2)
    with pytest.raises(ValueError, match="--data-parallel-size 3 must divide the world size .* 4"):
        layout_from_sizes(4, 3, None)
    with pytest.raises(ValueError, match="--data-parallel-size 2 x --tensor-parallel-size 1 must equal"):
        layout_from_sizes(4, 2, 1)
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 must divide"):
        layout_from_sizes(4, None, 3)
    with pytest.raises(ValueError, match=">= 1, got 0"):
        layout_from_sizes(4, 0, None)


def test_one_process_group_checks_the_sizes(monkeypatch):
    """Without torchrun a plain size-1 group; sizes above 1 are refused, naming them."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for dp, tp in [(None, None), (1, None), (None, 1), (1, 1)]:
        group = init_tp_group(data_parallel_size=dp, tensor_parallel_size=tp)
        assert (group.tp_size, group.dp_size, group.rank) == (1, 1, 0)
    with pytest.raises(ValueError, match="--data-parallel-size 2 must divide the world size .* 1"):
        init_tp_group(data_parallel_size=2)
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 must divide the world size .* 1"):
        init_tp_group(tensor_parallel_size=2)


def test_offline_split_balances_tokens_in_input_order():
    reqs = [request_from_dict({"id": f"r{i}", "prompt": "x" * 40, "max_tokens": m}, i, 16)
            for i, m in enumerate([100, 10, 10, 10, 50, 10])]
    assert request_cost(reqs[0]) == 110
    shares = assign_to_replicas(reqs, 2)
    assert [[r.request_id for r in s] for s in shares] == [["r0", "r5"], ["r1", "r2", "r3", "r4"]]
    assert assign_to_replicas(reqs, 1) == [reqs]
    bad = request_from_dict({"id": "b", "prompt": "x", "colour": 1}, 9, 16)
    assert bad.is_finished and request_cost(bad) == 0
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        assign_to_replicas(reqs, 0)
