"""Per-row log-sum-exp and cumulative sum in a fixed order (Triton, the sampler's CUDA path).

torch's CUDA reductions and scans choose how to split a row by the
tensor's shape, so a row's ``logsumexp`` can change with the number of rows
in the batch.  Here one program owns one row and walks it in chunks of
:data:`BLOCK` columns from column 0: element ``j`` always sits in lane
``j % BLOCK`` of chunk ``j // BLOCK``, whatever the row count or the row
length.  So a row's result depends on its own values only, and appending
``-inf`` (log-sum-exp) or ``0`` (cumsum) columns, as a longer candidate
list of another batch does, leaves every earlier result's bits unchanged
(adding an exact zero is exact).  Used by :func:`tpguide.sampling.sampler._finish`
on the CUDA code path (:func:`tpguide.kernels.triton_path.use_triton`);
runs on CPU tensors under ``TRITON_INTERPRET=1``.  docs/gpu.md, "Exactness on CUDA".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Columns per chunk: a constant, so the order never depends on the row length.
BLOCK = 128


@triton.jit
def _logsumexp_rows_kernel(x_ptr, out_ptr, stride_x, K, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    lane_max = tl.full((BLOCK,), float("-inf"), dtype=x_ptr.dtype.element_ty)
    for start in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < K, other=float("-inf"))
        lane_max = tl.maximum(lane_max, x)
    m = tl.max(lane_max, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # an all -inf row: exp(-inf) = 0 below, result -inf
    acc = tl.zeros((BLOCK,), dtype=x_ptr.dtype.element_ty)
    for start in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=start + cols < K, other=float("-inf"))
        acc += tl.exp(x - m_safe)
    tl.store(out_ptr + row, m_safe + tl.log(tl.sum(acc, axis=0)))


@triton.jit
def _cumsum_rows_kernel(x_ptr, out_ptr, stride_x, stride_out, K, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    carry = tl.sum(tl.zeros((BLOCK,), dtype=x_ptr.dtype.element_ty), axis=0)
    for start in range(0, K, BLOCK):
        ok = start + cols < K
        x = tl.load(x_ptr + row * stride_x + start + cols, mask=ok, other=0.0)
        c = tl.cumsum(x, axis=0) + carry
        tl.store(out_ptr + row * stride_out + start + cols, c, mask=ok)
        carry = tl.sum(tl.where(cols == BLOCK - 1, c, 0.0), axis=0)  # the chunk's last prefix, exactly


def _check(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{name} needs a float32/float64 [rows, K] tensor, got {x.dtype} {list(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """``log(sum(exp(x), dim=-1))`` per row in a fixed order (as ``torch.logsumexp``, to rounding).

    Parameters
    ----------
    x : torch.Tensor
        float32 or float64 ``[rows, K]``; ``-inf`` entries count as 0, an
        all ``-inf`` row gives ``-inf``.

    Returns
    -------
    torch.Tensor
        ``[rows]`` of ``x``'s dtype, a new tensor; a row's bits depend on its
        values only, and trailing ``-inf`` columns do not change them.

    Raises
    ------
    ValueError
        Another dtype or rank.
    """
    x = _check(x, "logsumexp_rows")
    out = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _logsumexp_rows_kernel[(x.shape[0],)](x, out, x.stride(0), x.shape[1], BLOCK=BLOCK)
    return out


def cumsum_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.cumsum(dim=-1)`` per row in a fixed order (as torch's, to rounding).

    Parameters
    ----------
    x : torch.Tensor
        float32 or float64 ``[rows, K]``.

    Returns
    -------
    torch.Tensor
        ``[rows, K]`` of ``x``'s dtype, a new tensor; prefix ``j`` depends on
        columns ``0..j`` of its own row only (a longer row does not change it).

    Raises
    ------
    ValueError
        Another dtype or rank.
    """
    x = _check(x, "cumsum_rows")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        _cumsum_rows_kernel[(x.shape[0],)](x, out, x.stride(0), out.stride(0), x.shape[1], BLOCK=BLOCK)
    return out
