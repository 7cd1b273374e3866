"""TP-invariant row-parallel reductions (docs/architecture.md §6).

A row-parallel layer ``y = x W^T`` with ``W [O, I]`` sums over ``I``.  Split
over ranks, each rank sums its columns and an all-reduce adds the parts, so
a different ``tp_size`` is a different order of floating-point additions and
bf16 logits (then tokens) change with ``tp_size``.  Here the sum runs over
fixed **reduction units** instead, independent of ``tp_size``::

    I columns   | unit 0 | unit 1 | unit 2 | ... | unit U-1 | padded units |
    tp 2 ranks  [ rank 0 ......... ][ rank 1 ............................ ]
    tp 3 ranks  [ rank 0 ...][ rank 1 ...][ rank 2 ....................... ]

* ``o_proj``: one unit per attention head (``head_dim`` columns); zero-padded
  heads sit after the real ones and are dropped before the sum;
* ``down_proj``: blocks of :func:`reduction_block_size` columns, chosen so
  that the shard boundary of every size in :data:`INVARIANT_TP_SIZES` is a
  block boundary.

Each rank computes its units' partials with one ``bmm`` (fp32 or the model
dtype's GEMM, which accumulates in fp32 internally), casts them to fp32,
all-gathers them (``[tp_size, U_local, T, O]``: the same units in the same
order on every rank) and sums the ``U`` real units with one ``torch.sum``
over the unit dimension.  That tensor has the same shape at every
``tp_size`` (and at tp 1, with no communication), so the additions happen in
the same order everywhere; measured on CPU, neither the per-unit ``bmm``
nor the ``sum`` depends on the thread count (``tests/multigpu/test_tp_invariance.py``).
The cost is ``U`` times the bytes of a plain all-reduce, still one collective.

On CUDA, cuBLAS picks kernels (tiles, split-K) per shape, so the matmuls of
the invariant path run through a fixed-tiling Triton kernel
(:mod:`tpguide.kernels.matmul_fixed_tiling_triton`): :func:`unit_partials`
and :func:`invariant_linear` (column-parallel layers and the LM head, whose
shard width changes with ``tp_size``).  On CPU, torch's GEMMs were measured
to give the same columns at every shard width, so they are used as they are.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from tpguide.dist import TPGroup
from tpguide.dist import group as collectives

#: The tp sizes whose results agree bit for bit (plus the running one, see
#: :func:`reduction_block_size`).
INVARIANT_TP_SIZES = (1, 2, 3, 4)


def reduction_block_size(dim: int, tp_size: int, tp_sizes: Iterable[int] = INVARIANT_TP_SIZES) -> int:
    """Columns per reduction unit of a ``dim``-wide row-parallel input (``down_proj``).

    The largest block such that every shard boundary ``k * dim / t`` for
    ``t`` in ``tp_sizes`` (those that divide ``dim``) and for ``tp_size`` is a
    block boundary: ``gcd(dim / t)``.  SmolLM2-135M: ``dim=1536`` gives 128
    (12 units).  A ``tp_size`` outside ``tp_sizes`` that needs a smaller
    block changes the units, so it agrees with the others only up to rounding.

    Raises
    ------
    ValueError
        If ``dim`` is not divisible by ``tp_size``.
    """
    if tp_size < 1 or dim % tp_size:
        raise ValueError(f"input_size={dim} is not divisible by tp_size={tp_size}")
    sizes = {t for t in tp_sizes if t >= 1 and dim % t == 0} | {tp_size}
    return math.gcd(*(dim // t for t in sizes))


def unit_partials(x: torch.Tensor, weight_units: torch.Tensor) -> torch.Tensor:
    """Per-unit products of this rank's columns.

    Parameters
    ----------
    x : torch.Tensor
        ``[T, U_local * B]`` model dtype (tokens, this rank's input columns).
    weight_units : torch.Tensor
        ``[U_local, B, O]`` model dtype, contiguous.

    Returns
    -------
    torch.Tensor
        fp32 ``[U_local, T, O]``: ``out[u] = x[:, u*B:(u+1)*B] @ weight_units[u]``.
    """
    num_units, block, _ = weight_units.shape
    xu = x.reshape(x.shape[0], num_units, block).transpose(0, 1)  # [U_local, T, B]
    if x.is_cuda:
        from tpguide.kernels.matmul_fixed_tiling_triton import bmm_fixed_tiling

        return bmm_fixed_tiling(xu, weight_units)  # fp32 accumulation, one order for every shape
    return torch.bmm(xu, weight_units).float()  # [U_local, T, O]


def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` whose columns do not depend on how many rows ``weight`` has.

    ``x [T, K]``, ``weight [N, K]`` -> ``[T, N]`` in ``x``'s dtype.  CUDA: the
    fixed-tiling Triton kernel (fp32 accumulation, rounded once); CPU:
    ``F.linear``.
    """
    if x.is_cuda:
        from tpguide.kernels.matmul_fixed_tiling_triton import linear_fixed_tiling

        return linear_fixed_tiling(x, weight).to(x.dtype)
    return torch.nn.functional.linear(x, weight)


def sum_units(partials: torch.Tensor, num_real_units: int, group: TPGroup) -> torch.Tensor:
    """Gather every rank's unit partials and sum the real units in unit order.

    Parameters
    ----------
    partials : torch.Tensor
        fp32 ``[U_local, T, O]``, this rank's units (global units
        ``tp_rank * U_local ..``); the same shape on every rank.
    num_real_units : int
        Units before the zero padding (``U <= tp_size * U_local``).
    group : TPGroup
        The one communication point: an all-gather (nothing at tp 1).

    Returns
    -------
    torch.Tensor
        fp32 ``[T, O]``, identical on every rank and at every tp size.
    """
    gathered = collectives.all_gather_stacked(partials, group).flatten(0, 1)  # [tp * U_local, T, O]
    return gathered[:num_real_units].sum(0)  # [T, O]
