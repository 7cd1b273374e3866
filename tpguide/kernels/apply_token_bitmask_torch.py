"""Vectorised torch path of :func:`tpguide.kernels.apply_token_bitmask_inplace`.

The default on CPU; it also runs on any other device torch supports.  Two
strategies, both bit-exact (a disallowed NaN logit also becomes ``-inf``):

* **dense** -- the logits are viewed as integers of the same width and each
  chunk of rows gets ``x = (x & keep) | ninf`` where ``keep``/``ninf`` come from
  a 256-entry lookup table indexed by the bitmask's bytes (one vectorised
  gather each, two vectorised bitwise passes, chunks sized to stay in cache);
* **sparse** -- when most words are all ones (a free-string state), only the
  words that are not ``-1`` are unpacked and only their logits touched
  (gather 32-logit blocks, same bit operations, scatter back), so all-ones
  words cost one comparison, as in xgrammar's CPU kernel which skips them.

The ``d2t`` draft path gathers one word per column (TensorRT-LLM's
``contiguousLogitsBitmaskKernel`` with the global draft id) and uses
``masked_fill_``.
"""

from __future__ import annotations

import sys

import torch

BITS_PER_WORD = 32
#: Logits elements per dense chunk: temporaries stay in the last-level cache.
CHUNK_ELEMENTS = 1 << 19
#: The sparse strategy is used when at most this fraction of words is not all ones.
SPARSE_MAX_FRACTION = 0.125
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
_TABLES: dict = {}

assert sys.byteorder == "little", "the byte lookup tables assume little-endian int32 words"


def _tables(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keep, ninf, disallowed)`` lookup tables indexed by a bitmask byte.

    ``keep``/``ninf``: ``[256, 8]`` integers of ``dtype``'s width; bit ``k`` of the
    byte set gives ``keep=-1, ninf=0`` (leave the logit), clear gives
    ``keep=0, ninf=bits(-inf)``.  ``disallowed``: ``[256]`` int64 whose 8 bytes
    are the 8 bools ``not bit k``.
    """
    key = (dtype, device)
    if key not in _TABLES:
        int_dtype = _INT_VIEW[dtype]
        ninf_bits = int(torch.tensor(float("-inf"), dtype=dtype).view(int_dtype))
        byte = torch.arange(256, dtype=torch.int32).unsqueeze(1)
        allowed = ((byte >> torch.arange(8, dtype=torch.int32)) & 1).bool()  # [256, 8]
        keep = torch.where(allowed, -1, 0).to(int_dtype)
        ninf = torch.where(allowed, 0, ninf_bits).to(int_dtype)
        disallowed = (~allowed).to(torch.uint8).contiguous().view(torch.int64).reshape(256)
        _TABLES[key] = (keep.to(device), ninf.to(device), disallowed.to(device))
    return _TABLES[key]


def apply_token_bitmask_inplace_torch(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    *,
    token_mask: torch.Tensor | None = None,
    d2t: torch.Tensor | None = None,
    draft_vocab_start_index: int = 0,
    strategy: str = "auto",
) -> None:
    """Set disallowed logits to ``-inf`` in place with vectorised torch ops.

    Arguments are assumed valid (the dispatcher checks them); see
    :func:`tpguide.kernels.apply_token_bitmask_inplace` for the contract.

    Parameters
    ----------
    logits : torch.Tensor
        ``[num_rows, width]`` float32/float16/bfloat16, any strides; in place.
    bitmask : torch.Tensor
        ``[num_rows, num_words]`` int32 words, any strides.
    token_mask : torch.Tensor, optional
        ``[num_rows]`` int32; rows where it is 0 are neither read nor written.
    d2t : torch.Tensor, optional
        ``[width]`` int32 draft-to-target offsets; ``bitmask`` is then the full row.
    draft_vocab_start_index : int
        First global draft id of this shard (tokens).
    strategy : {"auto", "dense", "sparse"}
        Force a strategy (tests); ``"auto"`` picks by the fraction of all-ones words.
    """
    if token_mask is not None:
        rows = token_mask.nonzero().flatten()  # [num_active]
        if rows.numel() < logits.shape[0]:
            if rows.numel() == 0:
                return
            sub = logits.index_select(0, rows)  # [num_active, width], a copy
            apply_token_bitmask_inplace_torch(
                sub, bitmask.index_select(0, rows), d2t=d2t,
                draft_vocab_start_index=draft_vocab_start_index, strategy=strategy,
            )
            logits.index_copy_(0, rows, sub)
            return
    if d2t is not None:
        _apply_d2t(logits, bitmask, d2t, draft_vocab_start_index)
        return
    num_rows, width = logits.shape
    num_words = min(bitmask.shape[1], -(-width // BITS_PER_WORD))  # words that hold a column
    covered = min(width, BITS_PER_WORD * num_words)  # columns that have a bit
    if covered < width:  # columns past the slice's words: disallowed
        logits[:, covered:].fill_(float("-inf"))
    if num_words == 0:
        return
    words = bitmask[:, :num_words]  # [num_rows, num_words]
    if strategy == "auto":
        not_ones = words != -1
        num_not_ones = int(torch.count_nonzero(not_ones))
        if num_not_ones == 0:
            return
        sparse = num_not_ones <= SPARSE_MAX_FRACTION * not_ones.numel()
        strategy = "sparse" if sparse else "dense"
    else:
        not_ones = None
    if strategy == "sparse":
        _apply_sparse(logits, words, covered, not_ones)
    else:
        _apply_dense(logits, words, covered)


def _apply_dense(logits: torch.Tensor, words: torch.Tensor, covered: int) -> None:
    """``x = (x & keep) | ninf`` on the integer view, chunk of rows by chunk of rows."""
    num_rows, num_words = words.shape
    keep_table, ninf_table, _ = _tables(logits.dtype, logits.device)
    bits = logits.view(_INT_VIEW[logits.dtype])  # same strides, integer dtype
    rows_per_chunk = max(1, CHUNK_ELEMENTS // (BITS_PER_WORD * num_words))
    for start in range(0, num_rows, rows_per_chunk):
        stop = min(num_rows, start + rows_per_chunk)
        # byte: [rows * num_words * 4] int32, the bitmask's bytes in bit order
        byte = words[start:stop].contiguous().view(torch.uint8).reshape(-1).int()
        keep = keep_table.index_select(0, byte).view(stop - start, -1)[:, :covered]
        ninf = ninf_table.index_select(0, byte).view(stop - start, -1)[:, :covered]
        bits[start:stop, :covered].bitwise_and_(keep).bitwise_or_(ninf)


def _apply_sparse(
    logits: torch.Tensor, words: torch.Tensor, covered: int, not_ones: torch.Tensor | None
) -> None:
    """Touch only the logits of words that are not all ones.

    Works on flat views (``index_select``/``index_copy_``/``index_fill_`` are
    much cheaper than 2-D advanced indexing on CPU): the 32 logits of each
    such word are gathered as one block when the strides allow, else the
    disallowed tokens' element offsets get one ``index_fill_``.
    """
    num_rows, num_words = words.shape
    if not_ones is None:
        not_ones = words != -1
    flat_word = not_ones.view(-1).nonzero().squeeze(1)  # [num_mixed] index into words.reshape(-1)
    if flat_word.numel() == 0:
        return
    mixed = words.reshape(-1).index_select(0, flat_word)  # [num_mixed] int32, a fresh tensor
    row = torch.div(flat_word, num_words, rounding_mode="floor")
    word = flat_word - row * num_words
    if covered < BITS_PER_WORD * num_words:  # padding bits of the last word read as allowed
        pad = _signed32(~((1 << (covered - BITS_PER_WORD * (num_words - 1))) - 1))
        mixed |= torch.where(word == num_words - 1, pad, 0).int()
    row_stride, col_stride = logits.stride()
    keep_table, ninf_table, disallowed_table = _tables(logits.dtype, logits.device)
    byte = mixed.view(torch.uint8).int()  # [num_mixed * 4]
    if col_stride == 1 and row_stride % BITS_PER_WORD == 0 and covered == BITS_PER_WORD * num_words:
        # Each word's 32 logits are one row of a [num_blocks, 32] view: gather them, apply
        # (x & keep) | ninf, scatter back.
        num_blocks = (num_rows - 1) * (row_stride // BITS_PER_WORD) + num_words
        bits = logits.view(_INT_VIEW[logits.dtype])
        blocks = bits.as_strided((num_blocks, BITS_PER_WORD), (BITS_PER_WORD, 1), bits.storage_offset())
        block_id = row * (row_stride // BITS_PER_WORD) + word  # [num_mixed]
        values = blocks.index_select(0, block_id)  # [num_mixed, 32]
        values.bitwise_and_(keep_table.index_select(0, byte).view(-1, BITS_PER_WORD))
        values.bitwise_or_(ninf_table.index_select(0, byte).view(-1, BITS_PER_WORD))
        blocks.index_copy_(0, block_id, values)
        return
    # General strides: element offsets of the disallowed tokens, one index_fill_.
    disallowed = disallowed_table.index_select(0, byte).view(torch.bool).view(-1, BITS_PER_WORD)
    base = row * row_stride + word * (BITS_PER_WORD * col_stride)  # [num_mixed] element offsets
    lanes = torch.arange(0, BITS_PER_WORD * col_stride, col_stride, device=logits.device)
    offsets = (base.unsqueeze(1) + lanes).masked_select(disallowed)  # [num_disallowed]
    span = (num_rows - 1) * row_stride + (logits.shape[1] - 1) * col_stride + 1
    flat = logits.as_strided((span,), (1,))  # 1-D view over every element of logits
    flat.index_fill_(0, offsets, float("-inf"))


def _signed32(value: int) -> int:
    """A Python int as the int32 with the same low 32 bits."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _apply_d2t(logits: torch.Tensor, bitmask: torch.Tensor, d2t: torch.Tensor, draft_vocab_start_index: int) -> None:
    """Draft shard: column ``j`` reads target bit ``draft_vocab_start_index + j + d2t[j]``."""
    num_rows, width = logits.shape
    num_bits = BITS_PER_WORD * bitmask.shape[1]
    columns = torch.arange(width, dtype=torch.int64, device=logits.device)
    target = draft_vocab_start_index + columns + d2t.long()  # [width] global target ids
    out_of_range = (target < 0) | (target >= num_bits)
    if num_bits == 0:
        logits.fill_(float("-inf"))
        return
    target = target.clamp(0, num_bits - 1)
    word_index = target >> 5  # [width]
    shift = (target & 31).int()
    rows_per_chunk = max(1, CHUNK_ELEMENTS // width)
    for start in range(0, num_rows, rows_per_chunk):
        stop = min(num_rows, start + rows_per_chunk)
        gathered = bitmask[start:stop].index_select(1, word_index)  # [rows, width] int32
        disallowed = ((gathered >> shift) & 1 == 0) | out_of_range
        logits[start:stop].masked_fill_(disallowed, float("-inf"))
