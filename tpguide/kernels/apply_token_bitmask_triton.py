"""Triton kernel of :func:`tpguide.kernels.apply_token_bitmask_inplace` (CUDA default).

One program per ``(row, block of BLOCK_SIZE columns)``.  After xgrammar's
``apply_token_bitmask_inplace_kernel`` (broadcast-unpack of a block's words)
and TensorRT-LLM's ``logitsBitmaskKernel`` (whole-word fast paths, token mask,
``d2t`` gather), with:

* logits are never read: one masked block store of ``-inf`` on the
  disallowed lanes (xgrammar's choice; TensorRT-LLM's read-modify-write of
  mixed packs moves more bytes), so an all-ones word touches no logits, an
  all-zeros word is a plain store, and a block without a disallowed token
  returns after loading its words;
* 64-bit element offsets (``rows * vocab`` passes 2**31 at e.g. 16k rows of
  151936);
* one coalesced block load of a block's words and one coalesced, predicated
  block store (per-token predicates rule out 16-byte vector stores; the
  sm_90 PTX has 8 ``st.global.b32`` per thread for 1024 columns);
* any row and column strides of logits and bitmask (a stride of 1 is
  specialised by Triton);
* the draft path: column ``j`` reads target bit
  ``draft_vocab_start_index + j + d2t[j]`` of the full bitmask row.

Runs on CPU tensors under ``TRITON_INTERPRET=1`` (the tests do so).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpguide.kernels.bitmask_layout import BITS_PER_WORD
from tpguide.kernels.triton_path import compiles_for_cuda


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,  # [num_rows, width] float, written in place
    bitmask_ptr,  # [num_rows, num_words] int32
    token_mask_ptr,  # [num_rows] int32 (unused unless HAS_TOKEN_MASK)
    d2t_ptr,  # [width] int32 (unused unless HAS_D2T)
    width,
    num_words,
    draft_vocab_start_index,
    logits_row_stride,
    logits_col_stride,
    bitmask_row_stride,
    bitmask_col_stride,
    HAS_TOKEN_MASK: tl.constexpr,
    HAS_D2T: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0)
    block = tl.program_id(1)
    row64 = row.to(tl.int64)
    columns = block * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)  # [BLOCK_SIZE] int32
    in_width = columns < width
    bitmask_row = bitmask_ptr + row64 * bitmask_row_stride
    if HAS_D2T:
        d2t = tl.load(d2t_ptr + columns, mask=in_width, other=0)
        target = draft_vocab_start_index + columns.to(tl.int64) + d2t  # global target ids
        has_bit = in_width & (target >= 0) & (target < num_words * 32)
        word = tl.load(bitmask_row + (target >> 5) * bitmask_col_stride, mask=has_bit, other=0)
        bit = tl.where(has_bit, (word >> (target & 31).to(tl.int32)) & 1, 0)  # 1 = allowed
        disallowed = in_width & (bit == 0)
    else:
        word_index = block * (BLOCK_SIZE // 32) + tl.arange(0, BLOCK_SIZE // 32)
        words = tl.load(bitmask_row + word_index * bitmask_col_stride, mask=word_index < num_words, other=0)
        bits = (words[:, None] >> tl.arange(0, 32)[None, :]) & 1  # [BLOCK_SIZE // 32, 32]
        disallowed = in_width & (tl.reshape(bits, (BLOCK_SIZE,)) == 0)
    if HAS_TOKEN_MASK:
        row_flag = tl.load(token_mask_ptr + row) + tl.zeros((BLOCK_SIZE,), tl.int32)  # broadcast
        disallowed = disallowed & (row_flag != 0)
    # Logits are never read: a masked store writes -inf to the disallowed lanes only,
    # so an all-ones word touches no logits and an all-zeros word is a plain store.
    if tl.sum(disallowed.to(tl.int32), axis=0) > 0:  # a block with nothing to mask returns
        pointers = logits_ptr + row64 * logits_row_stride + columns.to(tl.int64) * logits_col_stride
        ninf = tl.full((BLOCK_SIZE,), float("-inf"), logits_ptr.dtype.element_ty)
        tl.store(pointers, ninf, mask=disallowed)


def _is_interpreted() -> bool:
    """True when ``TRITON_INTERPRET=1`` made the kernel a Python interpreter function."""
    return type(_apply_token_bitmask_kernel).__name__ == "InterpretedFunction"


def apply_token_bitmask_inplace_triton(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    *,
    token_mask: torch.Tensor | None = None,
    d2t: torch.Tensor | None = None,
    draft_vocab_start_index: int = 0,
    block_size: int = 1024,
) -> None:
    """Set disallowed logits to ``-inf`` in place with one Triton launch.

    Arguments are assumed valid (the dispatcher checks them); see
    :func:`tpguide.kernels.apply_token_bitmask_inplace` for the contract.

    Parameters
    ----------
    logits : torch.Tensor
        ``[num_rows, width]`` float32/float16/bfloat16 on CUDA (or CPU under
        ``TRITON_INTERPRET=1``), any strides; written in place.
    bitmask : torch.Tensor
        ``[num_rows, num_words]`` int32 words, same device, any strides.
    token_mask : torch.Tensor, optional
        ``[num_rows]`` int32; rows where it is 0 are neither read nor written.
    d2t : torch.Tensor, optional
        ``[width]`` int32 draft-to-target offsets; ``bitmask`` is then the full row.
    draft_vocab_start_index : int
        First global draft id of this shard (tokens).
    block_size : int
        Columns per program, a power of two >= 32.

    Raises
    ------
    ValueError
        CPU tensors without ``TRITON_INTERPRET=1``, or a bad ``block_size``.
    """
    if logits.device.type == "cpu" and not (_is_interpreted() or compiles_for_cuda(logits)):
        raise ValueError("the triton backend needs CUDA tensors (or TRITON_INTERPRET=1), got cpu tensors")
    if block_size < BITS_PER_WORD or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= {BITS_PER_WORD}, got {block_size}")
    num_rows, width = logits.shape
    num_words = bitmask.shape[1]
    if num_rows == 0 or width == 0:
        return
    # Unused pointer arguments get a valid tensor; the constexpr flags skip them.
    grid = (num_rows, triton.cdiv(width, block_size))
    _apply_token_bitmask_kernel[grid](
        logits,
        bitmask,
        token_mask.contiguous() if token_mask is not None else bitmask,
        d2t.contiguous() if d2t is not None else bitmask,
        width,
        num_words,
        draft_vocab_start_index,
        logits.stride(0),
        logits.stride(1),
        bitmask.stride(0),
        bitmask.stride(1),
        HAS_TOKEN_MASK=token_mask is not None,
        HAS_D2T=d2t is not None,
        BLOCK_SIZE=block_size,
        num_warps=4 if block_size <= 1024 else 8,
    )
