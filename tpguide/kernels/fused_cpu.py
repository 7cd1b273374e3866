"""Fused element-wise kernels of the fixed-order CPU decoder step (docs/architecture.md §6, "Fused element-wise kernels").

Each replaces a chain of small torch ops of the TP-invariant CPU path with
one pass of ``csrc/fixed_order_cpu.c`` and gives the **same bits** as the
chain: the same fp32 operations in the same order (compiled with
``-ffp-contract=off``, so no fused multiply-add where torch has none), and in
bf16 a rounding to bf16 (nearest even, as ``.to(torch.bfloat16)``) at every
point where torch stores a bf16 tensor.  Rows are independent and each is
computed by one thread, so nothing depends on the batch or the thread count.

* :func:`fused_add_rms_norm`: vLLM's ``fused_add_rms_norm``, the residual add
  and :class:`~tpguide.model.norm.RMSNorm` with the fixed 16-lane mean square;
* :func:`act_and_mul`: vLLM's ``SiluAndMul`` (and GeGLU) on the merged
  ``gate_up_proj`` output;
* :func:`rotary_fixed_order`: RoPE (RoFormer, rotate-half layout) of q and k
  in one call, writing k and v straight into the paged KV cache.

fp32 and bf16 tensors on CPU only; the callers keep the torch expressions for
CUDA and for the plain (non-invariant) mode.
"""

from __future__ import annotations

from typing import Optional

import torch

from tpguide.kernels.fixed_order_cpu import DTYPE_CODES, UNARY_OPS, library, threads_for

#: The activations :func:`act_and_mul` takes (:data:`~tpguide.kernels.fixed_order_cpu.UNARY_OPS` names).
ACT_AND_MUL_OPS = ("silu", "gelu_tanh")


def takes(t: torch.Tensor) -> bool:
    """True for a tensor these kernels take: on CPU, float32 or bfloat16."""
    return t.device.type == "cpu" and t.dtype in DTYPE_CODES


def _code(t: torch.Tensor, what: str) -> int:
    code = DTYPE_CODES.get(t.dtype)
    if not takes(t):
        raise ValueError(f"{what} must be a float32 or bfloat16 CPU tensor, got {t.dtype} on {t.device}")
    return code


def fused_add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMS norm in one pass (vLLM's ``fused_add_rms_norm``).

    The bits of ``h = x + residual`` and
    ``RMSNorm(h) = weight * (h.float() * torch.rsqrt(mean_square_fixed_order(h) + eps)).to(dtype)``
    (:class:`~tpguide.model.norm.RMSNorm` on the fixed-order path): the add
    rounded to ``x``'s dtype, the mean of squares by the same fixed 16-lane
    dot product (``mean_square_fixed_order``), ``rsqrt`` as ``1 / sqrt``.

    Parameters
    ----------
    x : torch.Tensor
        ``[..., D]`` fp32 or bf16 (tokens [, heads], hidden), CPU.
    residual : torch.Tensor or None
        ``x``'s shape and dtype; None: no add (the norm of ``x``).
    weight : torch.Tensor
        ``[D]``, ``x``'s dtype.
    eps : float

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``out`` (``x``'s shape and dtype, contiguous) and the new residual
        ``h`` (``x`` itself when ``residual`` is None).

    Raises
    ------
    ValueError
        Another dtype or device, mismatched shapes or dtypes.
    """
    code = _code(x, "x")
    d = x.shape[-1]
    if weight.dtype != x.dtype or weight.shape != (d,) or (
            residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape)):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype}, residual "
                         f"{None if residual is None else (tuple(residual.shape), residual.dtype)} and weight "
                         f"{tuple(weight.shape)} {weight.dtype} do not match")
    xc = x.contiguous()
    rc = None if residual is None else residual.contiguous()
    w = weight.contiguous()
    out = torch.empty_like(xc)
    h = xc if rc is None else torch.empty_like(xc)
    rows = xc.numel() // d if d else 0
    if rows:
        status = library().tpguide_add_rms_norm(xc.data_ptr(), None if rc is None else rc.data_ptr(), w.data_ptr(),
                                                code, rows, d, float(eps), out.data_ptr(),
                                                None if rc is None else h.data_ptr(), threads_for(rows * d))
        if status != 0:
            raise MemoryError("tpguide_add_rms_norm: no scratch row")
    return out, h


def act_and_mul(gate_up: torch.Tensor, op: str = "silu") -> torch.Tensor:
    """Gated activation of the merged gate/up projection (vLLM's ``SiluAndMul``; GeGLU with ``"gelu_tanh"``).

    The bits of ``gate, up = gate_up.chunk(2, -1)``;
    ``unary_fixed_order(gate, op).to(dtype) * up``.

    Parameters
    ----------
    gate_up : torch.Tensor
        ``[T, 2 * I]`` fp32 or bf16 on CPU (tokens, gate then up), rows of unit stride.
    op : str
        One of :data:`ACT_AND_MUL_OPS`.

    Returns
    -------
    torch.Tensor
        ``[T, I]``, ``gate_up``'s dtype.

    Raises
    ------
    ValueError
        Another dtype, device or layout, an odd width, or an unknown ``op``.
    """
    code = _code(gate_up, "gate_up")
    if op not in ACT_AND_MUL_OPS:
        raise ValueError(f"op must be one of {ACT_AND_MUL_OPS}, got {op!r}")
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2 * I], got {tuple(gate_up.shape)}")
    x = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
    t, i = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, i, dtype=x.dtype)
    if t and i:
        status = library().tpguide_act_and_mul(x.data_ptr(), x.stride(0), code, t, i, UNARY_OPS[op], out.data_ptr(),
                                               threads_for(t * i))
        if status != 0:
            raise MemoryError("tpguide_act_and_mul: no scratch row")
    return out


def _heads(x: torch.Tensor, what: str) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``x`` as ``[T, H, D]`` with a unit last stride (copied only if it has none), and its strides."""
    if x.dim() != 3:
        raise ValueError(f"{what} must be [T, heads, head_dim], got {tuple(x.shape)}")
    strides = x.stride()
    if strides[2] != 1:
        x = x.contiguous()
        strides = x.stride()
    return x, strides


def rotary_fixed_order(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       v: Optional[torch.Tensor] = None, k_cache: Optional[torch.Tensor] = None,
                       v_cache: Optional[torch.Tensor] = None,
                       rows: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding (RoFormer, Su et al. 2021; HF Llama's rotate-half layout) of q and k in one pass.

    The bits of ``x * cos + rotate_half(x) * sin`` on the first ``R`` elements of
    each head and ``x`` on the rest (partial rotary), for ``x`` = q and k, with
    ``cos``/``sin`` in the tensors' dtype (in bf16 each product and the sum
    rounded, as torch's bf16 ops).  With ``k_cache``, the rotated keys (and
    ``v``) go straight into the cache rows ``rows``, the bits of
    ``k_cache.view(-1, Hkv, D)[rows] = k`` (and ``v``).

    Parameters
    ----------
    q : torch.Tensor
        ``[T, H, D]`` fp32 or bf16 (tokens, query heads, head dim); any strides with unit last stride.
    k : torch.Tensor
        ``[T, Hkv, D]``, ``q``'s dtype.
    cos, sin : torch.Tensor
        ``[T, R]`` (or ``[T, 1, R]``), ``q``'s dtype, ``R`` even, ``R <= D``.
    v : torch.Tensor, optional
        ``[T, Hkv, D]``: copied into ``v_cache`` (needs ``k_cache``).
    k_cache, v_cache : torch.Tensor, optional
        ``[num_blocks, block_size, Hkv, D]`` contiguous, ``q``'s dtype (the paged pool).
    rows : torch.Tensor, optional
        int64 ``[T]``: the flat cache row ``block * block_size + offset`` of each token.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        Rotated ``q`` ``[T, H, D]`` contiguous, and rotated ``k``: a new
        ``[T, Hkv, D]``, or ``k_cache`` (written in place) when one is given.

    Raises
    ------
    ValueError
        Another dtype or device, mismatched shapes, a bad ``R``, a cache without
        ``rows`` (or ``v`` without ``v_cache``), a non-contiguous cache, or a row
        outside the cache.
    """
    code = _code(q, "q")
    (q, qs), (k, ks) = _heads(q, "q"), _heads(k, "k")
    t, h, d = q.shape
    hkv = k.shape[1]
    cos, sin = cos.reshape(t, -1).contiguous(), sin.reshape(t, -1).contiguous()
    r = cos.shape[1]
    if k.dtype != q.dtype or k.shape != (t, hkv, d) or cos.dtype != q.dtype or sin.dtype != q.dtype \
            or sin.shape != cos.shape or r % 2 or r > d:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)} {k.dtype}, cos/sin "
                         f"{tuple(cos.shape)} {cos.dtype} / {tuple(sin.shape)} {sin.dtype} do not match")
    if k_cache is None:
        if v is not None or v_cache is not None or rows is not None:
            raise ValueError("v, v_cache and rows need a k_cache")
        k_out, num_rows, row_ptr = torch.empty(t, hkv, d, dtype=q.dtype), t, None
    else:
        if rows is None or rows.shape != (t,) or k_cache.dtype != q.dtype or k_cache.shape[2:] != (hkv, d) \
                or not k_cache.is_contiguous() or (v is None) != (v_cache is None) or (
                    v_cache is not None and (v_cache.shape != k_cache.shape or v_cache.dtype != q.dtype
                                             or not v_cache.is_contiguous())):
            raise ValueError(f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} (contiguous, with rows [T] and v "
                             f"with v_cache) does not fit q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}")
        rows = rows.to(torch.int64).contiguous()
        k_out, num_rows, row_ptr = k_cache, k_cache.shape[0] * k_cache.shape[1], rows.data_ptr()
    vs = (0, 0)
    if v is not None:
        v, vs = _heads(v, "v")
        if v.shape != k.shape or v.dtype != q.dtype:
            raise ValueError(f"v {tuple(v.shape)} {v.dtype} does not match k {tuple(k.shape)} {k.dtype}")
    q_out = torch.empty(t, h, d, dtype=q.dtype)
    if t:
        status = library().tpguide_rotary(
            q.data_ptr(), qs[0], qs[1], k.data_ptr(), ks[0], ks[1], None if v is None else v.data_ptr(), vs[0], vs[1],
            code, t, h, hkv, d, r, cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr(),
            None if v_cache is None else v_cache.data_ptr(), row_ptr, num_rows, threads_for(t * (h + 2 * hkv) * d))
        if status != 0:
            raise ValueError(f"cache rows must lie in [0, {num_rows}), got {rows.tolist()}")
    return q_out, k_out
