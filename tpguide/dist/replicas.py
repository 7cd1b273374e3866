"""Data parallel x tensor parallel: how the torchrun world splits into replicas (TP groups).

docs/architecture.md §1 "Data parallel".  ``D`` replicas of ``T`` ranks each,
``world_size = D * T``; global rank ``r`` belongs to replica
``dp_rank = r // T`` as ``tp_rank = r % T``; replica ``d``'s driver is global
rank ``d * T``; global rank 0 (replica 0's driver) is also the front end::

    world (D=2, T=2):   rank 0   rank 1 | rank 2   rank 3
    dp_rank             0        0      | 1        1
    tp_rank             0        1      | 0        1
    role                front end       | driver
                        + driver        |

:class:`ReplicaLayout` is the pure arithmetic; :func:`new_tp_process_groups`
creates one ``torch.distributed`` group per replica, on every rank, in
replica order (``new_group`` is collective over the world).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, List, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class ReplicaLayout:
    """The split of ``world_size`` ranks into ``dp_size`` replicas of ``tp_size`` ranks.

    Raises
    ------
    ValueError
        ``dp_size < 1``, or ``world_size`` not a multiple of ``dp_size`` (names both).
    """

    world_size: int
    dp_size: int

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.dp_size}")
        if self.world_size < 1 or self.world_size % self.dp_size:
            raise ValueError(f"--data-parallel-size {self.dp_size} must divide the world size "
                             f"(torchrun's --nnodes x --nproc-per-node) {self.world_size}")

    @property
    def tp_size(self) -> int:
        """Ranks per replica, ``T = world_size // dp_size``."""
        return self.world_size // self.dp_size

    def dp_rank_of(self, rank: int) -> int:
        """The replica of global ``rank``: ``rank // T``."""
        return rank // self.tp_size

    def tp_rank_of(self, rank: int) -> int:
        """Global ``rank``'s place in its replica: ``rank % T``."""
        return rank % self.tp_size

    def ranks_of(self, dp_rank: int) -> List[int]:
        """Global ranks of replica ``dp_rank``, ascending; the first is its driver."""
        return list(range(dp_rank * self.tp_size, (dp_rank + 1) * self.tp_size))

    def driver_rank(self, dp_rank: int) -> int:
        """Global rank of replica ``dp_rank``'s driver (its tp_rank 0)."""
        return dp_rank * self.tp_size


def describe_replica(dp_rank: int, tp_size: int) -> str:
    """``"replica 1 (global ranks 2-3)"``: how errors and logs name a replica."""
    first, last = dp_rank * tp_size, (dp_rank + 1) * tp_size - 1
    ranks = f"global rank {first}" if first == last else f"global ranks {first}-{last}"
    return f"replica {dp_rank} ({ranks})"


def layout_from_sizes(world_size: int, data_parallel_size: Optional[int],
                      tensor_parallel_size: Optional[int]) -> ReplicaLayout:
    """The layout of ``--data-parallel-size`` / ``--tensor-parallel-size`` (either, both or neither).

    Neither: one replica of the whole world.  Only ``T``: ``D = world_size // T``.

    Raises
    ------
    ValueError
        A size below 1, sizes whose product is not the world size, or a ``T``
        that does not divide it (each message names the values).
    """
    if tensor_parallel_size is not None and tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    if data_parallel_size is None:
        if tensor_parallel_size is None:
            return ReplicaLayout(world_size, 1)
        if world_size % tensor_parallel_size:
            raise ValueError(f"--tensor-parallel-size {tensor_parallel_size} must divide the world size "
                             f"(torchrun's --nnodes x --nproc-per-node) {world_size}")
        return ReplicaLayout(world_size, world_size // tensor_parallel_size)
    layout = ReplicaLayout(world_size, data_parallel_size)
    if tensor_parallel_size is not None and layout.tp_size != tensor_parallel_size:
        raise ValueError(f"--data-parallel-size {data_parallel_size} x --tensor-parallel-size "
                         f"{tensor_parallel_size} must equal the world size {world_size}")
    return layout


def new_tp_process_groups(layout: ReplicaLayout, rank: int, backend: str, timeout_s: float) -> Optional[Any]:
    """Create every replica's TP group (collective: call on every rank); return this rank's.

    One ``new_group`` per replica, in replica order, on every rank, as
    ``torch.distributed`` requires.  Returns None when ``tp_size == 1`` (the
    collectives are the identity; no group is created).
    """
    if layout.tp_size == 1:
        return None
    timeout = datetime.timedelta(seconds=timeout_s)
    mine = None
    for d in range(layout.dp_size):
        pg = dist.new_group(layout.ranks_of(d), timeout=timeout, backend=backend)
        if d == layout.dp_rank_of(rank):
            mine = pg
    return mine
