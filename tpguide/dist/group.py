"""The tensor-parallel group and the thin collectives over it.

The group: who am I, how many of us, which device.  ``init_tp_group`` reads
torchrun's environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``).  Without it (plain ``python``) it returns a size-1
group and never initialises ``torch.distributed``.

The collectives (:func:`all_reduce`, :func:`all_gather_stacked`,
:func:`broadcast_object`, :func:`broadcast_tensor`, :func:`scatter_tensor`,
:func:`barrier`), Megatron-style: plain functions, the group passed
explicitly, the identity at ``tp_size == 1`` (so the single-process path
never touches ``torch.distributed``).  Every collective is called by *every*
rank of the group in the same order (SPMD); the ``src`` of broadcasts and
scatters is the driver, ``tp_rank`` 0, except where a caller names another
(:func:`broadcast_tensor`'s ``src``).  :func:`send_tensor` / :func:`recv_tensor`
are point to point, between two ranks, and refuse a group of one.  Callers reach them through this
module (``from tpguide.dist import group as C``; ``tpguide/dist/__init__.py``),
so a test can wrap them.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from tpguide.dist.replicas import layout_from_sizes, new_tp_process_groups

#: Collective timeout (seconds), chosen deliberately.  A rank that *dies* is
#: noticed much sooner: gloo peers fail their next collective at once (closed
#: socket), and torchrun's agent stops every worker as soon as one exits
#: non-zero.  The timeout is the backstop for a rank that is alive but stuck
#: (or NCCL without torchrun), so it must exceed the longest legitimate wait
#: in a collective: the driver converting the default model on first use, or
#: compiling every request's grammar before the first step, while the other
#: ranks wait in a broadcast.  ``generate.py --collective-timeout`` sets it.
DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class TPGroup:
    """One rank's view of its tensor-parallel group.

    Attributes
    ----------
    tp_rank : int
        Rank inside the TP group, ``0 <= tp_rank < tp_size``.
    tp_size : int
        Number of ranks that share one model replica.
    device : torch.device
        This rank's device (``cuda:LOCAL_RANK`` under NCCL, ``cpu`` under gloo).
    process_group : torch.distributed.ProcessGroup or None
        ``None`` when ``tp_size == 1`` and ``torch.distributed`` is not used.
    backend : str
        ``"nccl"``, ``"gloo"`` or ``"none"`` (single process).
    dp_rank : int
        The replica this rank belongs to, ``0 <= dp_rank < dp_size``
        (data parallel, docs/architecture.md §1 "Data parallel").
    dp_size : int
        Number of replicas (TP groups) in the world.
    """

    tp_rank: int = 0
    tp_size: int = 1
    device: torch.device = torch.device("cpu")
    process_group: Optional[Any] = None
    backend: str = "none"
    dp_rank: int = 0
    dp_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank}")
        if self.tp_size > 1 and self.process_group is None:
            raise ValueError(f"tp_size={self.tp_size} > 1 needs a process_group")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"dp_rank must be in [0, {self.dp_size}), got {self.dp_rank}")

    @property
    def rank(self) -> int:
        """This process's global rank: ``dp_rank * tp_size + tp_rank``."""
        return self.dp_rank * self.tp_size + self.tp_rank

    @property
    def is_driver(self) -> bool:
        """True on the driver (tp_rank 0): it owns requests, matchers and output."""
        return self.tp_rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def choose_backend(local_world_size: int) -> str:
    """NCCL when every local rank can own a CUDA device, gloo otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


def init_tp_group(
    backend: Optional[str] = None, timeout_s: float = DEFAULT_TIMEOUT_S,
    data_parallel_size: Optional[int] = None, tensor_parallel_size: Optional[int] = None,
) -> TPGroup:
    """Create this process's TP group from torchrun's environment.

    With ``data_parallel_size`` / ``tensor_parallel_size`` the world splits into
    replicas (:mod:`tpguide.dist.replicas`, docs/architecture.md §1 "Data
    parallel"); by default the whole world is one TP group.

    Parameters
    ----------
    backend : {"nccl", "gloo"}, optional
        Forces a backend; default chooses with :func:`choose_backend`.
    timeout_s : float
        Collective timeout in seconds (a dead peer fails the collective).
    data_parallel_size, tensor_parallel_size : int, optional
        ``D`` and ``T`` with ``D * T == WORLD_SIZE`` (either one implies the other).

    Returns
    -------
    TPGroup
        Size 1 without ``torch.distributed`` when ``WORLD_SIZE`` is unset or 1.

    Raises
    ------
    ValueError
        If ``backend`` is not ``"nccl"`` or ``"gloo"``, NCCL is asked for
        without enough CUDA devices, or the sizes do not split the world.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size == 1:  # a plain process
        if {data_parallel_size, tensor_parallel_size} - {None, 1}:
            layout_from_sizes(world_size, data_parallel_size, tensor_parallel_size)  # raises, naming the sizes
        return TPGroup(device=torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    layout = layout_from_sizes(world_size, data_parallel_size, tensor_parallel_size)
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    backend = backend or os.environ.get("TPGUIDE_BACKEND") or choose_backend(local_world_size)
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl":
        if torch.cuda.device_count() < local_world_size:
            raise ValueError(
                f"NCCL needs one CUDA device per local rank: {local_world_size} local ranks, "
                f"{torch.cuda.device_count()} CUDA devices"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
        store.set_timeout(timeout)
        check_same_device_type(exchange_device_types(store, rank, world_size, device.type))
        dist.init_process_group(
            backend=backend, store=dist.PrefixStore("default_pg", store), rank=rank,
            world_size=world_size, timeout=timeout,
            **({"device_id": device} if backend == "nccl" else {}),
        )
    if layout.dp_size == 1:
        return TPGroup(tp_rank=rank, tp_size=world_size, device=device, process_group=dist.group.WORLD,
                       backend=backend)
    return TPGroup(tp_rank=layout.tp_rank_of(rank), tp_size=layout.tp_size, device=device,
                   process_group=new_tp_process_groups(layout, rank, backend, timeout_s), backend=backend,
                   dp_rank=layout.dp_rank_of(rank), dp_size=layout.dp_size)


def exchange_device_types(store, rank: int, world_size: int, device_type: str) -> list[str]:
    """All-gather each rank's device type (``"cpu"``, ``"cuda"``) through the rendezvous store.

    Done before ``init_process_group``: ranks that disagree would pick
    different backends, whose initialisation could hang instead of failing.
    """
    prefix = f"tpguide/device_type/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    store.set(f"{prefix}{rank}", device_type)
    return [store.get(f"{prefix}{r}").decode() for r in range(world_size)]


def check_same_device_type(device_types: list[str]) -> None:
    """Raise ``ValueError`` naming the ranks if the ranks are not all on one device type.

    Sharded sampling is bit-identical across tp sizes only on one device
    type (docs/architecture.md §6), and NCCL needs every rank on CUDA.
    """
    kinds = sorted(set(device_types))
    if len(kinds) > 1:
        shown = "; ".join(f"{k} on rank(s) {[r for r, t in enumerate(device_types) if t == k]}" for k in kinds)
        raise ValueError(f"mixed device types across ranks ({shown}); every rank must use the same "
                         f"device type: give every rank a GPU, or hide the GPUs from all of them "
                         f"(CUDA_VISIBLE_DEVICES=\"\")")


def destroy_tp_group(group: TPGroup, barrier: bool = True) -> None:
    """Tear down ``torch.distributed`` if ``group`` used it (no-op at size 1).

    Safe order: a barrier first (``barrier=True``), so no rank destroys its
    process group while a peer is still inside the last collective (the stop
    plan's broadcast), then ``destroy_process_group``.

    Raises
    ------
    torch.distributed.DistError
        The barrier failed (a peer died or timed out).
    """
    if dist.is_initialized():
        if barrier and group.process_group is not None:
            dist.barrier(group=group.process_group)
        dist.destroy_process_group()


# ---------------------------------------------------------------------- collectives

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
    dist.broadcast_object_list(box, group_src=0, group=group.process_group, device=group.device)
    return box[0]


def broadcast_tensor(tensor: torch.Tensor, group: TPGroup, src: int = 0) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with rank ``src``'s (the driver's by default; same shape/dtype)."""
    if group.tp_size > 1:
        dist.broadcast(tensor, group_src=src, group=group.process_group)
    return tensor


def send_tensor(tensor: torch.Tensor, dst: int, group: TPGroup) -> None:
    """Send ``tensor`` to group rank ``dst`` (which calls :func:`recv_tensor`); blocks until it is sent.

    Raises ``ValueError`` at ``tp_size == 1`` (no other rank).
    """
    if group.tp_size == 1:
        raise ValueError("send_tensor needs a group of more than one rank")
    dist.send(tensor.contiguous(), group_dst=dst, group=group.process_group)


def recv_tensor(tensor: torch.Tensor, src: int, group: TPGroup) -> torch.Tensor:
    """Receive group rank ``src``'s :func:`send_tensor` into ``tensor`` (its shape and dtype) and return it.

    Raises ``ValueError`` at ``tp_size == 1`` (no other rank).
    """
    if group.tp_size == 1:
        raise ValueError("recv_tensor needs a group of more than one rank")
    dist.recv(tensor, group_src=src, group=group.process_group)
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
    dist.scatter(out, scatter_list, group_src=0, group=group.process_group)
    return out


def barrier(group: TPGroup) -> None:
    """Wait until every rank of the group arrives (no-op at size 1)."""
    if group.tp_size > 1:
        dist.barrier(group=group.process_group)
