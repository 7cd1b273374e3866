"""Write each new token's key and value at its KV-pool slot, skipping slot -1 (padding rows), in Triton.

An index assignment (``flat_k[slot_mapping] = k``) cannot skip padding rows
without a data-dependent selection; this kernel masks them instead, so a
padded CUDA-graph bucket writes exactly the real rows.  A copy, no
arithmetic: the cache holds the bits of ``k`` and ``v``.  Runs on CPU tensors
under ``TRITON_INTERPRET=1`` (the tests); docs/gpu.md, "Exactness on CUDA".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,  # k, v [T, Hkv, D], unit last stride
    stride_cs, stride_ch,  # the caches viewed as [num_blocks * block_size, Hkv, D]
    HEAD_DIM: tl.constexpr, D_P: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, D_P)
    mask = (d < HEAD_DIM) & ((d * 0 + slot) >= 0)  # [D_P]: nothing for a padding row
    dst = slot * stride_cs + h * stride_ch + d
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask), mask=mask)


def write_kv_cache_(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Copy ``k[t]``, ``v[t]`` to pool row ``slot_mapping[t]`` of the caches, in place; ``-1`` writes nothing.

    Parameters
    ----------
    k, v : torch.Tensor
        ``[T, Hkv, D]`` (tokens, KV heads, head dim), the caches' dtype and
        device, unit last stride.
    k_cache, v_cache : torch.Tensor
        ``[num_blocks, block_size, Hkv, D]``, contiguous; row ``block *
        block_size + offset`` of the flattened pool is written.
    slot_mapping : torch.Tensor
        int32 or int64 ``[T]``, contiguous: a flat pool row per token, or
        ``-1`` for a padding token.  Rows are not bounds-checked (that would
        read tensor values on the host).

    Raises
    ------
    ValueError
        Shapes, dtypes or devices that do not match (the message names them).
    """
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"need contiguous k/v caches of one shape [num_blocks, block_size, Hkv, D], got "
                         f"{list(k_cache.shape)} and {list(v_cache.shape)}")
    num_kv_heads, head_dim = k_cache.shape[2:]
    num_tokens = k.shape[0]
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape \
            or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"need k, v [T, {num_kv_heads}, {head_dim}] and slot_mapping [T], got "
                         f"{list(k.shape)}, {list(v.shape)}, {list(slot_mapping.shape)}")
    if {k.dtype, v.dtype, v_cache.dtype} != {k_cache.dtype} or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"k, v and the caches must share a dtype and slot_mapping be int32/int64, got {k.dtype}, "
                         f"{v.dtype}, {k_cache.dtype}, {v_cache.dtype}, {slot_mapping.dtype}")
    if any(x.device != k_cache.device for x in (k, v, v_cache, slot_mapping)):
        raise ValueError(f"every tensor must be on the caches' device {k_cache.device}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or not slot_mapping.is_contiguous():
        raise ValueError("k and v need a unit last stride and slot_mapping contiguity")
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), HEAD_DIM=head_dim, D_P=triton.next_power_of_2(head_dim),
    )
