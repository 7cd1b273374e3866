"""The TP-invariant unit sum ``((p0 + p1) + p2) + ...`` in one Triton launch, rounded once to the model dtype.

A row-parallel layer of the TP-invariant path (docs/architecture.md §6,
"Fixed-order reductions") adds its fp32 unit partials ``[U, T, O]`` in unit
order.  On CUDA that was ``partials[0].clone()``, ``U - 1`` in-place adds
and a ``.to(dtype)``: ``U + 1`` launches per layer (SmolLM2-135M: 9 for
``o_proj``, 12 for ``down_proj``, so 23 of a layer's ~45 kernels).  Here one
program owns :data:`BLOCK` output elements and adds the units into one fp32
accumulator in the same order, so every element gets the same IEEE
additions as the loop (an addition has nothing to fuse), then one
round-to-nearest-even store (:func:`~tpguide.kernels.triton_cast.cast_rne`,
the bits of torch's ``.to``).  An element's result depends on its own ``U``
values only: not on ``T``, its place, or the other rows.

Runs on CPU tensors under ``TRITON_INTERPRET=1`` (the tests), compiled on
CUDA (:func:`tpguide.model.invariant_reduce.sum_units_fixed_order_cuda`);
docs/gpu.md, "One step on CUDA".  Unit ``u`` is reached by stepping a
64-bit pointer ``u`` times by ``stride_u``, never through the int32 product
``u * stride_u``, which wrapped past ``2**31 - 1`` elements (a 70B
``o_proj`` above 4,161 tokens; docs/gpu.md, "Offsets at real model sizes").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpguide.kernels.triton_cast import cast_rne

#: Output elements per program.
BLOCK = 1024

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _sum_units_kernel(p_ptr, out_ptr, U, numel, stride_u, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    ptrs = p_ptr + offs
    acc = tl.load(ptrs, mask=ok, other=0.0)
    for _unit in range(1, U):  # unit order: ((p0 + p1) + p2) + ...
        ptrs += stride_u  # a 64-bit pointer stepped by one unit: no u * stride_u product to wrap in int32
        acc = acc + tl.load(ptrs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, cast_rne(acc, out_ptr.dtype.element_ty), mask=ok)


def sum_units_triton(partials: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp32 ``[U, T, O] -> [T, O]`` of ``out_dtype``: the units added in order, then rounded once.

    Parameters
    ----------
    partials : torch.Tensor
        fp32 ``[U, T, O]`` (units, tokens, output features), ``U >= 1``; each
        unit's ``[T, O]`` contiguous (``partials[u]`` may sit at any stride).
    out_dtype : torch.dtype
        float32, bfloat16 or float16.

    Returns
    -------
    torch.Tensor
        ``[T, O]`` of ``out_dtype``, a new tensor: the bits of
        ``(partials[0].clone() + partials[1] + ...).to(out_dtype)``.

    Raises
    ------
    ValueError
        ``partials`` is not a 3-d fp32 tensor with at least one unit and
        contiguous units, or ``out_dtype`` is not one of the three (the
        message names the values).
    """
    if partials.dim() != 3 or partials.dtype != torch.float32 or partials.shape[0] < 1:
        raise ValueError(f"partials must be fp32 [U >= 1, T, O], got {partials.dtype} {list(partials.shape)}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {sorted(map(str, _OUT_DTYPES))}, got {out_dtype}")
    units, tokens, features = partials.shape
    if tokens * features and partials[0].stride() != (features, 1):
        raise ValueError(f"each unit of partials must be a contiguous [T, O], got strides {partials.stride()}")
    out = torch.empty((tokens, features), dtype=out_dtype, device=partials.device)
    numel = out.numel()
    if numel:
        _sum_units_kernel[(triton.cdiv(numel, BLOCK),)](partials, out, units, numel, partials.stride(0),
                                                        BLOCK=BLOCK)
    return out
