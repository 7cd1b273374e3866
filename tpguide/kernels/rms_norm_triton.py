"""Residual add + RMS norm, one program per row, the row's sum of squares in a fixed order (Triton, CUDA path).

torch's CUDA reductions pick their split of a row by the tensor's shape, so
``mean(x^2)`` of a row can change with the number of rows.  Here each
program owns one row and walks it in ``BLOCK_D`` chunks from column 0,
accumulating ``x^2`` in an fp32 vector and summing that vector once at the
end: the order depends on the row length only (Thinking Machines Lab,
"Defeating Nondeterminism in LLM Inference", 2025: batch-invariant RMSNorm).

The casts are those of :mod:`tpguide.model.norm` (transformers' norms):

* Llama (``LlamaRMSNorm``): ``h = x + residual`` in the model dtype, then
  ``weight * (h.float() * rsqrt(mean(h.float()^2) + eps)).to(dtype)``;
* Gemma (``Gemma2RMSNorm``): ``(h.float() * rsqrt(...) * (1 + weight.float())).to(dtype)``.

``rsqrt`` is Triton's (on CUDA ``rsqrt.approx``), so results agree with the
CPU path to rounding, not bit for bit; what is exact is that a row's bits do
not depend on the other rows.  Runs on CPU tensors under
``TRITON_INTERPRET=1`` (the tests).  docs/gpu.md, "Exactness on CUDA".
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from tpguide.kernels.triton_cast import cast_rne

#: Columns per chunk of a row (at most; a shorter row uses one chunk of its padded width).
MAX_BLOCK_D = 1024


@triton.jit
def _load_h(x_ptrs, res_ptrs, ok, HAS_RESIDUAL: tl.constexpr):
    """``x`` or ``x + residual`` rounded to the model dtype (an fp32 add, as torch adds 16-bit floats)."""
    h = tl.load(x_ptrs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        h = cast_rne(h.to(tl.float32) + tl.load(res_ptrs, mask=ok, other=0.0).to(tl.float32), x_ptrs.dtype.element_ty)
    return h


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, h_ptr,
    stride_x, stride_res, stride_out, stride_h,
    D, eps,
    HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for start in range(0, D, BLOCK_D):  # pass 1: h = x + residual (model dtype), fp32 squares by lane
        c = start + cols
        ok = c < D
        h = _load_h(x_ptr + row * stride_x + c, res_ptr + row * stride_res + c, ok, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(h_ptr + row * stride_h + c, h, mask=ok)
        hf = h.to(tl.float32)
        acc += hf * hf
    inv = tl.rsqrt(tl.sum(acc, axis=0) / D + eps)
    for start in range(0, D, BLOCK_D):  # pass 2: normalize and scale
        c = start + cols
        ok = c < D
        h = _load_h(x_ptr + row * stride_x + c, res_ptr + row * stride_res + c, ok, HAS_RESIDUAL)  # not re-read
        w = tl.load(w_ptr + c, mask=ok, other=0.0)
        normed = h.to(tl.float32) * inv
        if GEMMA:
            y = normed * (1.0 + w.to(tl.float32))
        else:
            y = w.to(tl.float32) * cast_rne(normed, x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_out + c, cast_rne(y, out_ptr.dtype.element_ty), mask=ok)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None,
                    gemma: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(RMSNorm(x + residual), x + residual)`` per row, fixed order; a row's bits do not depend on the others.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., D]`` float32, float16 or bfloat16 (rows of any leading shape,
        e.g. tokens or ``[T, H]`` for per-head q/k norms).
    weight : torch.Tensor
        ``[D]``, ``x``'s dtype and device.
    eps : float
    residual : torch.Tensor, optional
        ``x``'s shape, dtype and device: added first (vLLM's ``fused_add_rms_norm``).
    gemma : bool
        Gemma's ``(1 + weight)`` in fp32, cast once at the end; else Llama's
        ``weight * x̂.to(dtype)`` (module docstring).

    Returns
    -------
    (torch.Tensor, torch.Tensor or None)
        The normed rows, ``x``'s shape and dtype; ``x + residual`` (None
        without ``residual``).  New tensors.

    Raises
    ------
    ValueError
        Mismatched shapes, dtypes or devices (the message names them).
    """
    d = x.shape[-1]
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or weight.shape != (d,) \
            or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"need float32/float16/bfloat16 x [..., D] and weight [D] of its dtype and device, got "
                         f"x {list(x.shape)} {x.dtype} on {x.device}, weight {list(weight.shape)} {weight.dtype} "
                         f"on {weight.device}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device):
        raise ValueError(f"residual {list(residual.shape)} {residual.dtype} on {residual.device} does not match "
                         f"x {list(x.shape)} {x.dtype} on {x.device}")
    rows = x.reshape(-1, d)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    res = None if residual is None else residual.reshape(-1, d)
    h = None if residual is None else torch.empty_like(out)
    if rows.shape[0] and d:
        w = weight.contiguous()
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        res = res if res is None or res.stride(-1) == 1 else res.contiguous()
        _add_rms_norm_kernel[(rows.shape[0],)](
            rows, rows if res is None else res, w, out, out if h is None else h,
            rows.stride(0), rows.stride(0) if res is None else res.stride(0), out.stride(0),
            out.stride(0) if h is None else h.stride(0), d, float(eps),
            HAS_RESIDUAL=res is not None, GEMMA=gemma, BLOCK_D=min(MAX_BLOCK_D, triton.next_power_of_2(d)),
        )
    return out.view(x.shape), None if h is None else h.view(x.shape)
