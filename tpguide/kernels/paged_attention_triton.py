"""Paged attention whose reduction order per query token depends on that token's position only (Triton, CUDA path).

One program per ``(query token t, KV head g)``: it loads the ``H / Hkv``
query heads of group ``g`` and walks the keys of its own sequence through
the block table, ``BLOCK_N`` keys at a time, starting at the multiple of
``BLOCK_N`` at or below its first visible key and going up to its own
position ``p``.  Scores, the online softmax (fp32, FlashAttention's running
max and sum) and ``P V`` are computed chunk by chunk in that order, so every
output element is a function of ``p``, the window, and the cached keys and
values of positions ``<= p`` of its sequence: not of the other tokens, how
many there are, where the sequence's blocks sit in the pool, or how its
prompt was chunked (chunked prefill equals one-shot prefill bit for bit).
This is the "fixed KV split size" of batch-invariant attention (Thinking
Machines Lab, "Defeating Nondeterminism in LLM Inference", 2025; SGLang's
deterministic mode), without split-KV.

A token with position ``< 0`` is padding (a CUDA-graph bucket's spare rows):
its program writes zeros and reads nothing.  The grid and every launch
argument come from tensor shapes and Python constants, never from tensor
values, so a launch can be captured in a CUDA graph.

Matrix products: ``tl.dot`` on CUDA (fp32 accumulation; fp32 inputs with
``input_precision="ieee"``, ``P V`` in fp32); under the Triton interpreter
(CPU tests, ``TRITON_INTERPRET=1``) an explicit fp32 product-and-sum, as in
:mod:`tpguide.kernels.matmul_fixed_tiling_triton`, because numpy's dot is not
position-independent.  docs/gpu.md, "Exactness on CUDA".
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from tpguide.kernels.triton_cast import cast_rne
from tpguide.kernels.triton_path import compiles_for_cuda

#: Keys per chunk of the fixed order (the "KV split size").
BLOCK_N = 32


@triton.jit(do_not_specialize=["stride_tab", "window"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_ptr, pos_ptr,
    stride_qt, stride_qh,  # q [T, H, D], unit last stride
    stride_kb, stride_ks, stride_kh,  # k_cache [num_blocks, block_size, Hkv, D], unit last stride
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,  # out [T, H, D], unit last stride
    stride_tab,  # block_tables row stride
    scale, softcap, window,
    KV_BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ON_CUDA: tl.constexpr, IEEE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    hi = tl.arange(0, GROUP_P)
    d = tl.arange(0, D_P)
    head_ok = hi < GROUP
    d_ok = d < HEAD_DIM
    heads = g * GROUP + hi  # [GROUP_P] query heads of this KV head
    out_ptrs = out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :]
    io_mask = head_ok[:, None] & d_ok[None, :]
    pos = tl.load(pos_ptr + t).to(tl.int64)
    if pos < 0:  # padding row: zeros, nothing read
        tl.store(out_ptrs, tl.zeros((GROUP_P, D_P), dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        seq = tl.load(seq_ptr + t).to(tl.int64)
        q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0)
        lo = pos * 0
        if HAS_WINDOW:
            lo = tl.maximum(pos - window + 1, 0)
        first = (lo // BLOCK_N) * BLOCK_N  # chunk boundaries at multiples of BLOCK_N: a function of pos only
        m_i = tl.full((GROUP_P,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((GROUP_P,), dtype=tl.float32)
        acc = tl.zeros((GROUP_P, D_P), dtype=tl.float32)
        for start in range(first, pos + 1, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
            key_ok = (j >= lo) & (j <= pos)
            blk = tl.load(tables_ptr + seq * stride_tab + j // KV_BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
            row = j % KV_BLOCK_SIZE
            kv_mask = key_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + blk[:, None] * stride_kb + row[:, None] * stride_ks + g * stride_kh + d[None, :],
                        mask=kv_mask, other=0.0)  # [BLOCK_N, D_P]
            v = tl.load(v_ptr + blk[:, None] * stride_vb + row[:, None] * stride_vs + g * stride_vh + d[None, :],
                        mask=kv_mask, other=0.0)
            if ON_CUDA:
                if IEEE:
                    s = tl.dot(q, tl.trans(k), input_precision="ieee")
                else:
                    s = tl.dot(q, tl.trans(k))  # 16-bit inputs, exact products, fp32 accumulation
            else:
                s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
            s = s * scale  # [GROUP_P, BLOCK_N] fp32
            if HAS_SOFTCAP:  # cap * tanh(s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1)
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * (s / softcap)) + 1.0))
            s = tl.where(key_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: the first chunk holds key lo
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if ON_CUDA:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptrs, cast_rne(out, out_ptr.dtype.element_ty), mask=io_mask)


def paged_attention_fixed_order(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, token_seq_index: torch.Tensor,
                                token_positions: torch.Tensor, scale: float,
                                sliding_window: Optional[int] = None, logit_softcap: Optional[float] = None,
                                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of each query token over its own sequence's cached keys, in a fixed order.

    Token ``t`` (query head ``h``, KV head ``h // (H / Hkv)``) of sequence
    ``s = token_seq_index[t]`` at position ``p = token_positions[t]`` attends
    cache positions ``max(0, p - sliding_window + 1) <= j <= p``; position ``j``
    lives in block ``block_tables[s, j // block_size]``, row ``j % block_size``,
    and must already be written (the same contract as
    :func:`tpguide.kernels.fixed_order_cpu.attention_fixed_order`).  ``p < 0``
    marks a padding row: its output is zero and nothing is read.  No host
    synchronization: nothing here reads tensor values on the host.

    Parameters
    ----------
    q : torch.Tensor
        ``[T, H, D]`` float32, float16 or bfloat16 (tokens, query heads, head
        dim), unit last stride.
    k_cache, v_cache : torch.Tensor
        ``[num_blocks, block_size, Hkv, D]``, ``q``'s dtype and device, unit last stride.
    block_tables : torch.Tensor
        int32 or int64 ``[num_seqs, max_blocks]``: block ids of each sequence's
        positions, unit last stride.
    token_seq_index, token_positions : torch.Tensor
        int32 or int64 ``[T]``, contiguous: each token's row of
        ``block_tables`` and its absolute position (``-1``: padding).
    scale : float
        Multiplies ``q . k``.
    sliding_window : int, optional
        Keys a query sees, itself included (None: all earlier keys).
    logit_softcap : float, optional
        Scores become ``cap * tanh(s / cap)`` before the mask (Gemma 2).
    out : torch.Tensor, optional
        ``[T, H, D]`` of ``q``'s dtype, unit last stride, written in place.

    Returns
    -------
    torch.Tensor
        ``[T, H, D]`` in ``q``'s dtype (``out`` when given).

    Raises
    ------
    ValueError
        Shapes, dtypes or devices that do not match (the message names them).
        Positions past a block table are not checked (that would read tensor
        values on the host); the callers' metadata guarantees them.
    """
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"need q [T, H, D] and k/v caches [num_blocks, block_size, Hkv, D], got "
                         f"{list(q.shape)}, {list(k_cache.shape)}, {list(v_cache.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    _, kv_block_size, num_kv_heads, dk = k_cache.shape
    if dk != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q has {num_heads} heads of {head_dim}, the caches {num_kv_heads} KV heads of {dk}: "
                         f"need equal head dims and num_heads % num_kv_heads == 0")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or k_cache.dtype != q.dtype \
            or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache, v_cache must share a float32/float16/bfloat16 dtype, got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    tensors = (k_cache, v_cache, block_tables, token_seq_index, token_positions)
    if any(x.device != q.device for x in tensors):
        raise ValueError(f"every tensor must be on q's device {q.device}, got {[str(x.device) for x in tensors]}")
    index = (block_tables, token_seq_index, token_positions)
    if any(x.dtype not in (torch.int32, torch.int64) for x in index) or block_tables.dim() != 2 \
            or token_seq_index.shape != (num_tokens,) or token_positions.shape != (num_tokens,):
        raise ValueError(f"need int32/int64 block_tables [S, max_blocks] and token_seq_index, token_positions "
                         f"[{num_tokens}], got {[(x.dtype, list(x.shape)) for x in index]}")
    if not (token_seq_index.is_contiguous() and token_positions.is_contiguous()) \
            or any(x.stride(-1) != 1 for x in (q, k_cache, v_cache, block_tables)):
        raise ValueError("q, the caches and block_tables need a unit last stride, the token indices contiguity")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out must be {list(q.shape)} {q.dtype} on {q.device} with a unit last stride, got "
                         f"{list(out.shape)} {out.dtype} on {out.device}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    on_cuda = compiles_for_cuda(q)
    min_dim = 16 if on_cuda else 1  # tl.dot needs every dimension >= 16
    _paged_attention_kernel[(num_tokens, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, token_seq_index, token_positions,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], out.stride(0), out.stride(1),
        block_tables.stride(0), float(scale), float(logit_softcap or 1.0), int(sliding_window or 0),
        KV_BLOCK_SIZE=kv_block_size, GROUP=group, GROUP_P=max(min_dim, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, D_P=max(min_dim, triton.next_power_of_2(head_dim)), BLOCK_N=BLOCK_N,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=logit_softcap is not None,
        ON_CUDA=on_cuda, IEEE=q.dtype == torch.float32,
    )
    return out
