"""Vectorised CPU path of :func:`tpguide.kernels.apply_token_bitmask_inplace`.

The CPU fallback when the C kernel (:mod:`.apply_token_bitmask_cpu`) cannot
be compiled, and the path for logits whose columns are strided; it also runs
(dense strategy, torch ops) on any other device.  Logits are handled as
integers of the same width, so every strategy is bit-exact (a disallowed NaN
logit also becomes ``-inf``).  On CPU the index-heavy steps run on zero-copy
NumPy views of the torch tensors (``np.take``/``np.flatnonzero`` cost a
fraction of their torch twins there).

* **dense** -- chunk by chunk of rows, ``x = (x & keep) | ninf`` where
  ``keep``/``ninf`` come from a 256-entry lookup table indexed by the
  bitmask's bytes (two gathers, two bitwise passes, chunks sized to stay in
  cache);
* **sparse** -- when most words are all ones (a free-string state), only the
  words that are not ``-1`` are unpacked and only their logits touched: the
  32 logits of such a word are gathered as one block, masked, scattered back
  (or, for strides that do not allow blocks, the disallowed offsets are set);
  all-ones words cost one comparison, as in xgrammar's CPU kernel.

The ``d2t`` draft path gathers one word per column (TensorRT-LLM's
``contiguousLogitsBitmaskKernel``, with the global draft id) and uses
``masked_fill_``.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from tpguide.kernels.bitmask_layout import BITS_PER_WORD

#: Logits elements per dense chunk: temporaries stay in cache.
CHUNK_ELEMENTS = 1 << 17
#: The sparse strategy is used when at most this fraction of words is not all ones.
SPARSE_MAX_FRACTION = 0.125
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
_TABLES: dict = {}

assert sys.byteorder == "little", "the byte lookup tables assume little-endian int32 words"


def _tables(dtype: torch.dtype, device: torch.device) -> tuple:
    """``(keep, ninf, disallowed)`` lookup tables indexed by a bitmask byte.

    ``keep``/``ninf``: ``[256, 8]`` integers of ``dtype``'s width; bit ``k`` of
    the byte set gives ``keep=-1, ninf=0`` (leave the logit), clear gives
    ``keep=0, ninf=bits(-inf)``.  ``disallowed``: ``[256, 8]`` bool, ``not bit k``.
    NumPy arrays on CPU, torch tensors on ``device`` otherwise.
    """
    key = (dtype, device)
    if key not in _TABLES:
        int_dtype = _INT_VIEW[dtype]
        ninf_bits = int(torch.tensor(float("-inf"), dtype=dtype).view(int_dtype))
        byte = torch.arange(256, dtype=torch.int32).unsqueeze(1)
        allowed = ((byte >> torch.arange(8, dtype=torch.int32)) & 1).bool()  # [256, 8]
        tables = (torch.where(allowed, -1, 0).to(int_dtype), torch.where(allowed, 0, ninf_bits).to(int_dtype),
                  ~allowed)
        if device.type == "cpu":
            _TABLES[key] = tuple(t.numpy() for t in tables)
        else:
            _TABLES[key] = tuple(t.to(device) for t in tables)
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
    """Set disallowed logits to ``-inf`` in place with vectorised CPU operations.

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
        Force a strategy (tests); ``"auto"`` picks by the fraction of all-ones
        words.  Off CPU only ``"dense"`` exists.
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
    if logits.device.type != "cpu":
        _apply_dense_torch(logits, words, covered)
        return
    bits = logits.view(_INT_VIEW[logits.dtype]).numpy()  # [num_rows, width] zero-copy integer view
    words = words.numpy()
    if strategy == "auto":
        num_not_ones = int(np.count_nonzero(words != -1))
        if num_not_ones == 0:
            return
        strategy = "sparse" if num_not_ones <= SPARSE_MAX_FRACTION * words.size else "dense"
    tables = _tables(logits.dtype, logits.device)
    if strategy == "sparse":
        _apply_sparse(bits, words, covered, tables)
    else:
        _apply_dense(bits, words, covered, tables)


def _apply_dense(bits: np.ndarray, words: np.ndarray, covered: int, tables: tuple) -> None:
    """``x = (x & keep) | ninf`` on the integer view, chunk of rows by chunk of rows."""
    num_rows, num_words = words.shape
    keep_table, ninf_table, _ = tables
    rows_per_chunk = max(1, CHUNK_ELEMENTS // (BITS_PER_WORD * num_words))
    for start in range(0, num_rows, rows_per_chunk):
        stop = min(num_rows, start + rows_per_chunk)
        byte = np.ascontiguousarray(words[start:stop]).reshape(-1).view(np.uint8)  # bit order
        chunk = bits[start:stop, :covered]
        chunk &= np.take(keep_table, byte, axis=0).reshape(stop - start, -1)[:, :covered]
        chunk |= np.take(ninf_table, byte, axis=0).reshape(stop - start, -1)[:, :covered]


def _apply_sparse(bits: np.ndarray, words: np.ndarray, covered: int, tables: tuple) -> None:
    """Touch only the logits of words that are not all ones, chunk of rows by chunk of rows."""
    num_rows, num_words = words.shape
    rows_per_chunk = max(1, CHUNK_ELEMENTS // num_words)
    if num_rows > rows_per_chunk:
        for start in range(0, num_rows, rows_per_chunk):
            _apply_sparse(bits[start:start + rows_per_chunk], words[start:start + rows_per_chunk], covered, tables)
        return
    flat_word = np.flatnonzero(words != -1)  # [num_mixed] indices into words.reshape(-1)
    if flat_word.size == 0:
        return
    mixed = words.reshape(-1)[flat_word]  # [num_mixed] int32, a fresh array
    row, word = np.divmod(flat_word, num_words)
    if covered < BITS_PER_WORD * num_words:  # padding bits of the last word read as allowed
        padding = np.array(~((1 << (covered % BITS_PER_WORD)) - 1) & 0xFFFFFFFF, np.uint32).view(np.int32)
        mixed[word == num_words - 1] |= padding
    byte = mixed.view(np.uint8)  # [num_mixed * 4]
    keep_table, ninf_table, disallowed_table = tables
    row_stride, col_stride = (s // bits.itemsize for s in bits.strides)
    if col_stride == 1 and row_stride % BITS_PER_WORD == 0 and covered == BITS_PER_WORD * num_words:
        # The 32 logits of word w of row r are row r * row_stride / 32 + w of a [blocks, 32] view.
        num_blocks = (num_rows - 1) * (row_stride // BITS_PER_WORD) + num_words
        blocks = np.lib.stride_tricks.as_strided(bits, (num_blocks, BITS_PER_WORD), (32 * bits.itemsize, bits.itemsize))
        block_id = row * (row_stride // BITS_PER_WORD) + word
        values = np.take(blocks, block_id, axis=0)  # [num_mixed, 32]
        values &= np.take(keep_table, byte, axis=0).reshape(-1, BITS_PER_WORD)
        values |= np.take(ninf_table, byte, axis=0).reshape(-1, BITS_PER_WORD)
        blocks[block_id] = values
        return
    # Other strides: the disallowed tokens' (row, column) pairs, set one by one (vectorised).
    disallowed = np.take(disallowed_table, byte, axis=0).reshape(-1, BITS_PER_WORD)  # [num_mixed, 32]
    which, lane = np.nonzero(disallowed)
    bits[row[which], word[which] * BITS_PER_WORD + lane] = ninf_table[0, 0]  # bits of -inf


def _apply_dense_torch(logits: torch.Tensor, words: torch.Tensor, covered: int) -> None:
    """The dense strategy with torch ops, for logits off CPU."""
    num_rows, num_words = words.shape
    keep_table, ninf_table, _ = _tables(logits.dtype, logits.device)
    bits = logits.view(_INT_VIEW[logits.dtype])
    rows_per_chunk = max(1, (CHUNK_ELEMENTS << 6) // (BITS_PER_WORD * num_words))
    for start in range(0, num_rows, rows_per_chunk):
        stop = min(num_rows, start + rows_per_chunk)
        byte = words[start:stop].contiguous().view(torch.uint8).reshape(-1).int()
        keep = keep_table.index_select(0, byte).view(stop - start, -1)[:, :covered]
        ninf = ninf_table.index_select(0, byte).view(stop - start, -1)[:, :covered]
        bits[start:stop, :covered].bitwise_and_(keep).bitwise_or_(ninf)


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
