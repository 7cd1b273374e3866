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
:func:`rotary_and_cache_write_triton` also writes the rotated k and the v
of each token at its KV-pool row in the same launch (the CUDA path of
:meth:`tpguide.model.attention.Attention.forward_rotary`), as the CPU
path's fused kernel does.

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

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
    v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,  # WRITE_CACHE: v [T, Hkv, D], caches, slots (else unused)
    stride_vt, stride_vh, stride_cs, stride_ch,  # the caches viewed as [num_blocks * block_size, Hkv, D]
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr,
    D_P: tl.constexpr, WRITE_CACHE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D_P)
    in_head = d < HEAD_DIM
    if h < NUM_HEADS:
        src = q_ptr + t * stride_qt + h * stride_qh
        dst = q_out_ptr + (t * NUM_HEADS + h) * HEAD_DIM
        keep = in_head
    else:
        src = k_ptr + t * stride_kt + (h - NUM_HEADS) * stride_kh
        if WRITE_CACHE:  # k rotated straight into its pool row, v copied beside it; slot -1 (padding): nothing
            slot = tl.load(slot_ptr + t).to(tl.int64)
            keep = in_head & ((d * 0 + slot) >= 0)
            dst = k_cache_ptr + slot * stride_cs + (h - NUM_HEADS) * stride_ch
            v = tl.load(v_ptr + t * stride_vt + (h - NUM_HEADS) * stride_vh + d, mask=keep)
            tl.store(v_cache_ptr + slot * stride_cs + (h - NUM_HEADS) * stride_ch + d, v, mask=keep)
        else:
            dst = k_out_ptr + (t * NUM_KV_HEADS + h - NUM_HEADS) * HEAD_DIM
            keep = in_head
    dtype = q_out_ptr.dtype.element_ty  # q, k, cos, sin and the outputs share it
    half = ROTARY_DIM // 2
    rotated = d < ROTARY_DIM
    x = tl.load(src + d, mask=in_head, other=0.0)
    partner = tl.where(d < half, d + half, d - half)
    xp = tl.load(src + partner, mask=rotated, other=0.0).to(tl.float32)
    turned = tl.where(d < half, -xp, xp)  # rotate_half: (x1, x2) -> (-x2, x1); a negation is exact
    c = tl.load(cos_ptr + t * stride_ct + d, mask=rotated, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + d, mask=rotated, other=0.0).to(tl.float32)
    a = cast_rne(x.to(tl.float32) * c, dtype).to(tl.float32)  # torch: x * cos, rounded
    b = cast_rne(turned * s, dtype).to(tl.float32)  # rotate_half(x) * sin, rounded
    y = cast_rne(a + b, dtype)  # their sum, rounded
    tl.store(dst + d, tl.where(rotated, y, x), mask=keep)


def _check(q, k, cos, sin) -> None:
    """Raise ValueError unless q, k, cos, sin fit :func:`rotary_triton` (the message names the values)."""
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"need q [T, H, D] and k [T, Hkv, D], got {list(q.shape)} and {list(k.shape)}")
    tokens, _, head_dim = q.shape
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


def _launch(q, k, cos, sin, q_out, k_out, cache) -> None:
    """One launch over every (token, head) of q and k; ``cache`` = (v, k_cache, v_cache, slot_mapping) or None."""
    tokens, num_heads, head_dim = q.shape
    if not tokens:
        return
    if cache is None:
        v = k_cache = v_cache = slots = q  # unused (WRITE_CACHE off): any pointer
        v_strides, cache_strides = (0, 0), (0, 0)
    else:
        v, k_cache, v_cache, slots = cache
        v_strides, cache_strides = (v.stride(0), v.stride(1)), (k_cache.stride(1), k_cache.stride(2))
    _rotary_kernel[(tokens, num_heads + k.shape[1])](
        q, k, cos, sin, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        sin.stride(0), v, k_cache, v_cache, slots, *v_strides, *cache_strides,
        NUM_HEADS=num_heads, NUM_KV_HEADS=k.shape[1], HEAD_DIM=head_dim, ROTARY_DIM=cos.shape[-1],
        D_P=triton.next_power_of_2(head_dim), WRITE_CACHE=cache is not None,
        enable_fp_fusion=False,
    )


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
    _check(q, k, cos, sin)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch(q, k, cos, sin, q_out, k_out, None)
    return q_out, k_out


def rotary_and_cache_write_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  slot_mapping: torch.Tensor) -> torch.Tensor:
    """:func:`rotary_triton`, with the rotated ``k`` and ``v`` written at their KV-pool rows in the same launch.

    The bits of ``rotary_triton`` followed by
    :func:`~tpguide.kernels.kv_cache_write_triton.write_kv_cache_` (one
    launch fewer per layer): q rotated into a new tensor; each token's
    rotated k and its v copied to row ``slot_mapping[t]`` of the flattened
    pool, nothing for ``-1`` (a padding token).

    Parameters
    ----------
    q, k, cos, sin : torch.Tensor
        As :func:`rotary_triton`.
    v : torch.Tensor
        ``[T, Hkv, D]``, ``k``'s dtype and device, unit last stride.
    k_cache, v_cache : torch.Tensor
        ``[num_blocks, block_size, Hkv, D]`` of ``k``'s dtype, contiguous.
    slot_mapping : torch.Tensor
        int32 or int64 ``[T]``, contiguous: a flat pool row per token or
        ``-1``; not bounds-checked (that would read device values on the host).

    Returns
    -------
    torch.Tensor
        The rotated q, contiguous ``[T, H, D]``.

    Raises
    ------
    ValueError
        As :func:`rotary_triton`, or a v, cache or slot tensor that does not fit.
    """
    _check(q, k, cos, sin)
    tokens, num_kv_heads, head_dim = k.shape
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2:] != (num_kv_heads, head_dim) \
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"need contiguous caches [num_blocks, block_size, {num_kv_heads}, {head_dim}], got "
                         f"{list(k_cache.shape)} and {list(v_cache.shape)}")
    if v.shape != k.shape or v.stride(-1) != 1 or slot_mapping.shape != (tokens,) \
            or slot_mapping.dtype not in (torch.int32, torch.int64) or not slot_mapping.is_contiguous():
        raise ValueError(f"need v {list(k.shape)} with a unit last stride and a contiguous int32/int64 slot_mapping "
                         f"[{tokens}], got v {list(v.shape)} {v.stride()}, slot_mapping {list(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}")
    if {v.dtype, k_cache.dtype, v_cache.dtype} != {k.dtype} \
            or any(x.device != q.device for x in (v, k_cache, v_cache, slot_mapping)):
        raise ValueError(f"v and the caches must have k's dtype {k.dtype}, and every tensor q's device {q.device}")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch(q, k, cos, sin, q_out, q_out, (v, k_cache, v_cache, slot_mapping))
    return q_out
