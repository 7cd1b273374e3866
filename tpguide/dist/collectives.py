"""Thin collectives over a :class:`~tpguide.dist.group.TPGroup`.

Megatron-style: plain functions, the group passed explicitly, the identity at
``tp_size == 1`` (so the single-process path never touches
``torch.distributed``).  Every function is called by *every* rank of the group
in the same order (SPMD); the ``src`` of broadcasts and scatters is the driver,
``tp_rank`` 0.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from tpguide.dist.group import TPGroup

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(tensor: torch.Tensor, group: TPGroup, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` over the group in place and return it.

    Parameters
    ----------
    tensor : torch.Tensor
        Any shape; same shape and dtype on every rank.
    op : {"sum", "max", "min"}

    Raises
    ------
    ValueError
        For an unknown ``op``.
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    if group.tp_size > 1:
        dist.all_reduce(tensor, op=_OPS[op], group=group.process_group)
    return tensor


def all_gather_stacked(tensor: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Gather ``tensor`` from every rank: ``[*shape] -> [tp_size, *shape]``.

    Row ``r`` of the result is rank ``r``'s tensor, on every rank.
    """
    if group.tp_size == 1:
        return tensor.unsqueeze(0)
    tensor = tensor.contiguous()
    out = torch.empty((group.tp_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_into_tensor(out, tensor, group=group.process_group) if tensor.is_cuda else (
        dist.all_gather(list(out.unbind(0)), tensor, group=group.process_group)
    )
    return out


def broadcast_object(obj: Any, group: TPGroup) -> Any:
    """Send a picklable object from the driver to every rank; returns it everywhere.

    Non-driver ranks pass anything (ignored), typically ``None``.
    """
    if group.tp_size == 1:
        return obj
    box = [obj if group.is_driver else None]
    dist.broadcast_object_list(box, src=0, group=group.process_group, device=group.device)
    return box[0]


def broadcast_tensor(tensor: torch.Tensor, group: TPGroup) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with the driver's (same shape/dtype)."""
    if group.tp_size > 1:
        dist.broadcast(tensor, src=0, group=group.process_group)
    return tensor


def scatter_tensor(
    out: torch.Tensor, chunks: Optional[Sequence[torch.Tensor]], group: TPGroup
) -> torch.Tensor:
    """Driver sends ``chunks[r]`` to rank ``r``; every rank receives into ``out``.

    Parameters
    ----------
    out : torch.Tensor
        This rank's receive buffer, shape and dtype of one chunk.
    chunks : sequence of torch.Tensor or None
        On the driver: ``tp_size`` tensors shaped like ``out``.  Ignored elsewhere.
    """
    if group.tp_size == 1:
        assert chunks is not None and len(chunks) == 1
        out.copy_(chunks[0])
        return out
    scatter_list: Optional[List[torch.Tensor]] = None
    if group.is_driver:
        assert chunks is not None and len(chunks) == group.tp_size
        scatter_list = [c.contiguous() for c in chunks]
    dist.scatter(out, scatter_list, src=0, group=group.process_group)
    return out


def barrier(group: TPGroup) -> None:
    """Wait until every rank of the group arrives (no-op at size 1)."""
    if group.tp_size > 1:
        dist.barrier(group=group.process_group)
