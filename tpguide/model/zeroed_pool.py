"""A zeroed KV pool tensor whose CPU pages the kernel zeroes on first touch (an anonymous mmap), not a memset.

docs/architecture.md §7 "KV cache".  ``torch.zeros`` of a CPU pool writes
every byte at start-up (about 1.4 s for the default 0.7 GB pool on a 2-core
AMD EPYC, docs/benchmarks.md "Fresh-process start-up on CPU"), while a
request touches only its own blocks.  An anonymous private mapping reads as
zeros by definition (POSIX ``MAP_ANONYMOUS``), is page-aligned, and costs a
page fault per 4 KiB page only where a block is written or read.  On CUDA
the pool stays ``torch.zeros`` (a device memset of HBM bandwidth).
"""

from __future__ import annotations

import math
import mmap
from typing import Optional, Sequence

import torch

__all__ = ["zeroed_pool", "check_pool_fits_memory", "available_memory_bytes"]


def zeroed_pool(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous tensor of zeros ``shape`` of ``dtype`` on ``device``.

    On the CPU its storage is an anonymous ``mmap`` (page-aligned, zero pages
    mapped on first touch, unmapped when the tensor is freed), so allocation
    costs no time proportional to its size; elsewhere ``torch.zeros``.  Any
    dtype: the bytes are viewed as ``dtype`` (all-zero bytes are ``+0`` in
    every float and integer dtype torch has).  The storage cannot be resized.

    Parameters
    ----------
    shape : sequence of int
        E.g. ``[num_blocks, block_size, num_local_kv_heads, head_dim]``.
    dtype : torch.dtype
    device : torch.device

    Raises
    ------
    ValueError
        If a dimension is negative.
    """
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"shape must have dimensions >= 0, got {shape}")
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # frombuffer holds a reference to the mapping: it is unmapped when the last tensor on it is freed
    raw = torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def check_pool_fits_memory(nbytes: int, what: str) -> None:
    """Refuse a CPU pool of ``nbytes`` (all its tensors together) larger than the system's ``MemAvailable``.

    A :func:`zeroed_pool`'s pages are committed only when touched, so
    without this check a pool too large for the machine would fail in the
    middle of a run instead of at start-up, as ``torch.zeros`` did.
    Nothing is checked where ``/proc/meminfo`` is absent.

    Raises
    ------
    MemoryError
        ``nbytes > MemAvailable``; the message names both and ``what``.
    """
    available = available_memory_bytes()
    if available is not None and nbytes > available:
        raise MemoryError(f"the KV pool needs {nbytes / 2**20:.0f} MiB ({what}) but the system has "
                          f"{available / 2**20:.0f} MiB available (MemAvailable): lower --kv-cache-memory or "
                          "--max-num-seqs / --max-model-len")


def available_memory_bytes(meminfo: str = "/proc/meminfo") -> Optional[int]:
    """``MemAvailable`` of ``meminfo`` in bytes (Linux), or None where the file or the field is absent."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return None
