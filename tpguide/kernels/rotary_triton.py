"""Rotate-half RoPE of q and k in one Triton launch, the bits of torch's ``x * cos + rotate_half(x) * sin``.

The model's CUDA path rotated q and k with torch ops: per tensor a multiply,
a negation, a concatenation, a multiply and an add, so 10 launches per layer
(SmolLM2-135M: 300 of a decode step's kernels).  Here one program rotates
one head of one token (q's heads, then k's) and writes a new contiguous
tensor.  Each element gets torch's roundings: ``a = rne(x * cos)``,
``b = rne(-x2 * sin)`` (or ``x1 * sin`` on the second half), ``rne(a + b)``,
each in fp32 and rounded to the model dtype
(:func:`~tpguide.kernels.triton_cast.cast_rne`), compiled without
multiply-add fusion (``enable_fp_fusion=False``, so fp32 keeps its two
roundings too).  Elements past the rotary dimension (partial rotary, Phi-3)
are copied.  A row's result depends on its own values and position only.

Runs on CPU tensors under ``TRITON_INTERPRET=1`` (the tests), compiled on
CUDA (:meth:`tpguide.model.rotary.RotaryEmbedding.forward` on the CUDA code
path); docs/gpu.md, "One step on CUDA".  RoPE: Su et al., "RoFormer" (2021),
in HF Llama's rotate-half layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpguide.kernels.triton_cast import cast_rne

_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr,
    D_P: tl.constexpr, DTYPE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < NUM_HEADS:
        src = q_ptr + t * stride_qt + h * stride_qh
        dst = q_out_ptr + (t * NUM_HEADS + h) * HEAD_DIM
    else:
        src = k_ptr + t * stride_kt + (h - NUM_HEADS) * stride_kh
        dst = k_out_ptr + (t * NUM_KV_HEADS + h - NUM_HEADS) * HEAD_DIM
    d = tl.arange(0, D_P)
    half = ROTARY_DIM // 2
    rotated = d < ROTARY_DIM
    x = tl.load(src + d, mask=d < HEAD_DIM, other=0.0)
    partner = tl.where(d < half, d + half, d - half)
    xp = tl.load(src + partner, mask=rotated, other=0.0).to(tl.float32)
    turned = tl.where(d < half, -xp, xp)  # rotate_half: (x1, x2) -> (-x2, x1); a negation is exact
    c = tl.load(cos_ptr + t * stride_ct + d, mask=rotated, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + d, mask=rotated, other=0.0).to(tl.float32)
    a = cast_rne(x.to(tl.float32) * c, DTYPE).to(tl.float32)  # torch: x * cos, rounded
    b = cast_rne(turned * s, DTYPE).to(tl.float32)  # rotate_half(x) * sin, rounded
    y = cast_rne(a + b, DTYPE)  # their sum, rounded
    tl.store(dst + d, tl.where(rotated, y, x), mask=d < HEAD_DIM)


def rotary_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of ``q`` and ``k`` (rotate-half layout) on the first ``R`` elements of each head; new tensors.

    Parameters
    ----------
    q : torch.Tensor
        ``[T, H, D]`` (tokens, heads, head dim) float32, bfloat16 or float16,
        unit last stride (a view into the fused QKV output is fine).
    k : torch.Tensor
        ``[T, Hkv, D]``, ``q``'s dtype and device, unit last stride.
    cos, sin : torch.Tensor
        ``[T, 1, R]`` of ``q``'s dtype (``R`` even, ``R <= D``), unit last
        stride: each token's table row, scaling included
        (:meth:`tpguide.model.rotary.RotaryEmbedding.cos_sin`).

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        Contiguous ``[T, H, D]`` and ``[T, Hkv, D]``: the bits of
        :func:`tpguide.model.rotary.apply_rotary` on each.

    Raises
    ------
    ValueError
        Shapes, dtypes, devices or strides that do not fit (the message names them).
    """
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"need q [T, H, D] and k [T, Hkv, D], got {list(q.shape)} and {list(k.shape)}")
    tokens, num_heads, head_dim = q.shape
    rotary_dim = cos.shape[-1]
    if cos.shape != (tokens, 1, rotary_dim) or sin.shape != cos.shape or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"need cos and sin [T={tokens}, 1, R] with R even and R <= D={head_dim}, got "
                         f"{list(cos.shape)} and {list(sin.shape)}")
    tensors = {"q": q, "k": k, "cos": cos, "sin": sin}
    if q.dtype not in _DTYPES or any(x.dtype != q.dtype or x.device != q.device for x in tensors.values()):
        raise ValueError("q, k, cos and sin must share one dtype (float32, bfloat16 or float16) and device, got "
                         + ", ".join(f"{n} {x.dtype} on {x.device}" for n, x in tensors.items()))
    if any(x.stride(-1) != 1 for x in tensors.values()):
        raise ValueError("q, k, cos and sin need a unit last stride, got "
                         + ", ".join(f"{n} {x.stride()}" for n, x in tensors.items()))
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens:
        _rotary_kernel[(tokens, num_heads + k.shape[1])](
            q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos.stride(0), sin.stride(0), NUM_HEADS=num_heads, NUM_KV_HEADS=k.shape[1], HEAD_DIM=head_dim,
            ROTARY_DIM=rotary_dim, D_P=triton.next_power_of_2(head_dim), DTYPE=_DTYPES[q.dtype],
            enable_fp_fusion=False,
        )
    return q_out, k_out
