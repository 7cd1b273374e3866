"""GGUF Q4_0 / Q4_1 blocks as torch int4 group-32 weights (building block of ``--quantization gguf``).

ggml's 4-bit blocks (``ggml-common.h``) hold 32 weights of one row::

    block_q4_0 { fp16 d;           uint8 qs[16]; }   w = (q - 8) * d
    block_q4_1 { fp16 d; fp16 m;   uint8 qs[16]; }   w = q * d + m
    element j < 16: qs[j] & 0xF,   element j + 16: qs[j] >> 4

torch's int4 weight-only kernels (``torch._weight_int4pack_mm_for_cpu``, the
CUDA ``torch._weight_int4pack_mm``) compute ``w = (q - 8) * scale + zero``
per group of 32 along K, so both block types map onto them with the same
``q``: Q4_0 ``scale = d, zero = 0``; Q4_1 ``scale = d, zero = m + 8 * d``.
:func:`gguf_q4_to_int4` does that in fp32, where it is exact (checked
against gguf's own dequantization in the tests).

The CPU kernel needs bf16 activations and bf16 scales (with fp32 or fp16
activations it is ~35x slower than an fp32 GEMM, measured on an AVX2 EPYC),
so :class:`Int4Weight` rounds ``scale`` and ``zero`` to bf16 once: the q
values are the file's, the group scales lose the fp16 bits bf16 lacks.

Status: conversion, sharding on group boundaries and the matmul are here and
tested; the model does not load GGUF files through it yet (docs/status.md, `--quantization gguf`).
"""

from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

GROUP_SIZE = 32
#: Bytes per 32-weight block.
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}


def gguf_q4_to_int4(data: np.ndarray, qtype: str, k: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpack a GGUF Q4_0 / Q4_1 tensor into int4 values and per-group scale and zero.

    Parameters
    ----------
    data : numpy.ndarray
        uint8 ``[N, (K / 32) * block_bytes]``: the tensor's raw blocks, one
        row per output feature (what ``gguf.GGUFReader`` gives as ``.data``).
    qtype : {"Q4_0", "Q4_1"}
    k : int
        Weights per row (the GGUF ``ne0``); a multiple of 32.

    Returns
    -------
    q : torch.Tensor
        int32 ``[N, K]`` in ``0..15``.
    scale, zero : torch.Tensor
        fp32 ``[N, K / 32]``: ``w[n, c] = (q[n, c] - 8) * scale[n, c // 32] + zero[n, c // 32]``.

    Raises
    ------
    ValueError
        Unknown ``qtype``, ``k`` not a multiple of 32, or a byte count that
        does not match ``k``.
    """
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"qtype must be one of {sorted(BLOCK_BYTES)}, got {qtype!r}")
    if k % GROUP_SIZE:
        raise ValueError(f"k={k} is not a multiple of the group size {GROUP_SIZE}")
    nbytes = BLOCK_BYTES[qtype]
    data = np.ascontiguousarray(data, dtype=np.uint8)
    if data.ndim != 2 or data.shape[1] != k // GROUP_SIZE * nbytes:
        raise ValueError(f"{qtype} data of shape {list(data.shape)} does not hold rows of k={k} weights "
                         f"({k // GROUP_SIZE * nbytes} bytes each)")
    n, groups = data.shape[0], k // GROUP_SIZE
    blocks = data.reshape(n, groups, nbytes)  # [N, G, bytes]
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, G]
    qs = blocks[:, :, nbytes - 16:]  # [N, G, 16]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)  # [N, K]: low nibbles first
    if qtype == "Q4_1":
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + np.float32(8.0) * d
    else:
        zero = np.zeros_like(d)
    return torch.from_numpy(q.astype(np.int32)), torch.from_numpy(d), torch.from_numpy(zero)


class Int4Weight:
    """An ``[N, K]`` weight as torch int4 group-32 (CPU kernel), with its shard helpers.

    Parameters
    ----------
    q : torch.Tensor
        int32 ``[N, K]`` in ``0..15``; ``K`` a multiple of 32.
    scale, zero : torch.Tensor
        ``[N, K / 32]`` (fp32), rounded to bf16 here.

    Raises
    ------
    ValueError
        Shapes that do not fit, or ``q`` outside ``0..15``.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> None:
        n, k = q.shape
        if k % GROUP_SIZE or scale.shape != (n, k // GROUP_SIZE) or zero.shape != scale.shape:
            raise ValueError(f"need q [N, K] with K % 32 == 0 and scale/zero [N, K/32], got "
                             f"{list(q.shape)}, {list(scale.shape)}, {list(zero.shape)}")
        if int(q.min()) < 0 or int(q.max()) > 15:
            raise ValueError(f"q must lie in 0..15, got {int(q.min())}..{int(q.max())}")
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.scales_and_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T``: ``x [T, K]`` any float dtype -> ``[T, N]`` in ``x``'s dtype (bf16 inside)."""
        y = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP_SIZE, self.scales_and_zeros)
        return y.to(x.dtype)


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N, K]`` weights ``(q - 8) * scale + zero`` per group of 32 (the oracle of the kernels)."""
    n, k = q.shape
    groups = q.float().view(n, k // GROUP_SIZE, GROUP_SIZE) - 8.0
    return (groups * scale.float()[..., None] + zero.float()[..., None]).view(n, k)


def shard_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dim: int, start: int,
               size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows (``dim=0``, column-parallel) or K columns (``dim=1``, row-parallel) ``[start, start + size)``.

    Raises
    ------
    ValueError
        A K slice whose ends are not on group (32) boundaries.
    """
    if dim == 0:
        return q[start:start + size], scale[start:start + size], zero[start:start + size]
    if start % GROUP_SIZE or size % GROUP_SIZE:
        raise ValueError(f"a K shard [{start}, {start + size}) must start and end on a group boundary "
                         f"(multiples of {GROUP_SIZE})")
    g0, g1 = start // GROUP_SIZE, (start + size) // GROUP_SIZE
    return q[:, start:start + size], scale[:, g0:g1], zero[:, g0:g1]
