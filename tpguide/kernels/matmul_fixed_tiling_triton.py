"""Batched matmul with a fixed tiling and no split-K, for TP-invariant layers on CUDA.

cuBLAS picks its kernel (tile shape, split-K) per problem shape, so the same
output column can be summed in a different order when a layer is sharded to
a different width: column-parallel outputs and row-parallel unit partials
would then depend on ``tp_size``.  This kernel fixes the order instead:

* one program per ``(batch, BLOCK_M rows, BLOCK_N columns)`` tile, with
  constant block sizes (no autotuning);
* each program walks ``K`` from 0 upwards in ``BLOCK_K`` steps, one fp32
  accumulator, no split-K, no atomics;

so element ``(b, i, j)`` is reduced in an order that depends only on ``K``
and the block sizes, not on ``M``, ``N``, the batch size or where the tile
sits.  fp32 inputs use ``input_precision="ieee"`` (no TF32).  Off CUDA (the
Triton interpreter, where ``tl.dot`` is numpy's BLAS, whose result depends
on a column's place in the tile, and mishandles 16-bit floats) a tile is an
fp32 product-and-sum over ``BLOCK_K`` instead; the compiled ``tl.dot`` path
is tested only when a GPU is present.  The output is
fp32 (the unit partials of :mod:`tpguide.model.invariant_reduce` stay fp32),
or rounded once at the store to the model dtype
(:func:`~tpguide.kernels.triton_cast.cast_rne`, the bits of ``.to``), which
saves the column-parallel layers a separate cast launch each.

Runs on CPU tensors under ``TRITON_INTERPRET=1`` (the tests do so); the
model uses it on CUDA only (:func:`tpguide.model.invariant_reduce.unit_partials`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpguide.kernels.triton_cast import cast_rne
from tpguide.kernels.triton_path import compiles_for_cuda

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 32


@triton.jit(do_not_specialize=["M"])  # one compiled variant for every row count (a step's tokens)
def _bmm_fixed_tiling_kernel(
    a_ptr, b_ptr, c_ptr,  # a [B, M, K], b [B, K, N], c [B, M, N] of the output dtype
    M, N, K,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    IEEE: tl.constexpr, ON_CUDA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_b = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns
    rk = tl.arange(0, BLOCK_K)
    a_base = a_ptr + pid_b * stride_ab + rm[:, None].to(tl.int64) * stride_am
    b_base = b_ptr + pid_b * stride_bb + rn[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # in order, the whole K on one program: no split-K
        kk = k0 + rk
        a = tl.load(a_base + kk[None, :] * stride_ak, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(b_base + kk[:, None] * stride_bk, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if ON_CUDA:
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        else:  # the interpreter: numpy's dot is neither position-independent nor right for 16-bit floats
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    c = c_ptr + pid_b * stride_cb + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn
    tl.store(c, cast_rne(acc, c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def bmm_fixed_tiling(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``a @ b`` per batch with a reduction order independent of ``M``, ``N`` and the batch size.

    Parameters
    ----------
    a : torch.Tensor
        ``[B, M, K]`` float32, float16 or bfloat16, any strides.
    b : torch.Tensor
        ``[B, K, N]``, the dtype and device of ``a``, any strides.
    out_dtype : torch.dtype
        float32 (default), bfloat16 or float16: the fp32 sums rounded once
        to it (the bits of ``.to(out_dtype)`` of the fp32 result).

    Returns
    -------
    torch.Tensor
        ``[B, M, N]`` of ``out_dtype`` (a new tensor), accumulated in fp32.

    Raises
    ------
    ValueError
        Mismatched shapes, dtypes or devices, or another ``out_dtype`` (the
        message names them).
    """
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"need a [B, M, K] and b [B, K, N], got {list(a.shape)} and {list(b.shape)}")
    if a.dtype != b.dtype or a.device != b.device:
        raise ValueError(f"a and b differ: {a.dtype} on {a.device} vs {b.dtype} on {b.device}")
    if a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {a.dtype}")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype must be float32, float16 or bfloat16, got {out_dtype}")
    batch, m, k = a.shape
    n = b.shape[2]
    c = torch.empty((batch, m, n), dtype=out_dtype, device=a.device)
    if c.numel() == 0:
        return c
    if k == 0:
        return c.zero_()
    grid = (batch, triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _bmm_fixed_tiling_kernel[grid](
        a, b, c, m, n, k, *a.stride(), *b.stride(), *c.stride(),
        IEEE=a.dtype == torch.float32, ON_CUDA=compiles_for_cuda(a), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return c


def linear_fixed_tiling(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x @ weight.T`` (``F.linear`` without bias) through :func:`bmm_fixed_tiling`.

    ``x [T, K]``, ``weight [N, K]`` -> ``[T, N]`` of ``out_dtype`` (fp32
    sums rounded once, as in :func:`bmm_fixed_tiling`); column ``j`` does not
    depend on which other rows of ``weight`` are present (a shard of it gives
    the matching columns bit for bit).
    """
    return bmm_fixed_tiling(x.unsqueeze(0), weight.t().unsqueeze(0), out_dtype)[0]
