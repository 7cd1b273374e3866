"""The tensor-parallel group: who am I, how many of us, which device.

``init_tp_group`` reads torchrun's environment (``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``).  Without it (plain ``python``) it
returns a size-1 group and never initialises ``torch.distributed``; every
collective in :mod:`tpguide.dist.collectives` is then the identity.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

#: Collective timeout.  A rank that dies makes the others fail a collective
#: after at most this long instead of hanging forever.
DEFAULT_TIMEOUT_S = 120.0


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
    """

    tp_rank: int = 0
    tp_size: int = 1
    device: torch.device = torch.device("cpu")
    process_group: Optional[Any] = None
    backend: str = "none"

    def __post_init__(self) -> None:
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {self.tp_rank}")
        if self.tp_size > 1 and self.process_group is None:
            raise ValueError(f"tp_size={self.tp_size} > 1 needs a process_group")

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
    backend: Optional[str] = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> TPGroup:
    """Create this process's TP group from torchrun's environment.

    Parameters
    ----------
    backend : {"nccl", "gloo"}, optional
        Forces a backend; default chooses with :func:`choose_backend`.
    timeout_s : float
        Collective timeout in seconds (a dead peer fails the collective).

    Returns
    -------
    TPGroup
        Size 1 without ``torch.distributed`` when ``WORLD_SIZE`` is unset or 1.

    Raises
    ------
    ValueError
        If ``backend`` is not ``"nccl"`` or ``"gloo"``, or NCCL is asked for
        without enough CUDA devices.
    """
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size == 1:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        return TPGroup(device=device)
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
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            **({"device_id": device} if backend == "nccl" else {}),
        )
    return TPGroup(
        tp_rank=rank,
        tp_size=world_size,
        device=device,
        process_group=dist.group.WORLD,
        backend=backend,
    )


def destroy_tp_group(group: TPGroup) -> None:
    """Tear down ``torch.distributed`` if ``group`` used it (no-op at size 1)."""
    if group.process_group is not None and dist.is_initialized():
        dist.destroy_process_group()
