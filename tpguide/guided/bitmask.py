"""The token bitmask on the driver: allocate, pack and unpack, check for dead ends, split per rank.

docs/architecture.md §2.  No ``torch.distributed`` here; the matchers that
fill it are :mod:`tpguide.guided.decoder`.

**The bitmask.**  A ``token_bitmask`` is int32 ``[num_rows, bitmask_size]``
on the CPU; bit ``i`` of word ``w`` set means token ``32*w + i`` is allowed.
The driver fills full rows, checks them for dead ends on the *full* row
(:func:`find_dead_end_rows`), then cuts each row into ``tp_size`` word slices
(:func:`split_bitmask`, ``tpguide.model.vocab_shard.bitmask_shard``)::

    full row   | w0 .. w(W/T-1) | w(W/T) .. w(2W/T-1) | ... |   W = bitmask_size
    rank       |      0         |          1          | ... |   T = tp_size
"""

from __future__ import annotations

from typing import Iterable, List, Optional

import numpy as np
import torch

from tpguide.kernels.bitmask_layout import BITS_PER_WORD
from tpguide.model.vocab_shard import bitmask_shard, get_bitmask_size


def allocate_token_bitmask(num_rows: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """A CPU ``token_bitmask`` with every token allowed.

    Parameters
    ----------
    num_rows : int
    vocab_size : int
        Tokens per row (use ``padded_vocab_size``).
    pin_memory : bool
        Page-locked host memory, for asynchronous copies to a GPU.

    Returns
    -------
    torch.Tensor
        int32 ``[num_rows, ceil(vocab_size / 32)]``, CPU, filled with -1 (all bits set).
    """
    if num_rows < 0 or vocab_size < 1:
        raise ValueError(f"need num_rows >= 0 and vocab_size >= 1, got {num_rows}, {vocab_size}")
    return torch.full(
        (num_rows, get_bitmask_size(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory
    )


def _valid_word_mask(bitmask_size: int, vocab_size: int) -> torch.Tensor:
    """int32 ``[bitmask_size]``: the bits of tokens ``< vocab_size`` in each word."""
    mask = torch.zeros(bitmask_size, dtype=torch.int64)
    full_words, rest = divmod(vocab_size, BITS_PER_WORD)
    mask[:full_words] = (1 << BITS_PER_WORD) - 1
    if rest and full_words < bitmask_size:
        mask[full_words] = (1 << rest) - 1
    # Reinterpret the low 32 bits as int32 (bit 31 is the sign bit).
    return torch.where(mask >= 1 << 31, mask - (1 << 32), mask).to(torch.int32)


def find_dead_end_rows(
    token_bitmask: torch.Tensor, padded_vocab_size: int, token_mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Rows that allow no token below ``padded_vocab_size``.

    Checked on the *full* row: a rank's slice may legitimately allow nothing,
    so a shard-local test is wrong.  Bits of ids ``>= padded_vocab_size`` in the
    last word do not count.  Pass ``org_vocab_size`` as ``padded_vocab_size``
    for the stricter test that ignores padded ids too.

    Parameters
    ----------
    token_bitmask : torch.Tensor
        int32 ``[num_rows, bitmask_size]`` with ``bitmask_size >= ceil(padded_vocab_size / 32)``.
    padded_vocab_size : int
        Tokens that can be sampled (ids ``< padded_vocab_size``).
    token_mask : torch.Tensor, optional
        int32 ``[num_rows]``; rows with 0 are unguided and never dead.

    Returns
    -------
    torch.Tensor
        bool ``[num_rows]`` on ``token_bitmask``'s device; True = dead end.

    Raises
    ------
    ValueError
        Wrong dtype/rank, or rows too short for ``padded_vocab_size``.
    """
    if token_bitmask.dtype != torch.int32 or token_bitmask.dim() != 2:
        raise ValueError(
            f"token_bitmask must be int32 [num_rows, bitmask_size], got {token_bitmask.dtype} "
            f"{tuple(token_bitmask.shape)}"
        )
    needed = get_bitmask_size(padded_vocab_size)
    if token_bitmask.shape[1] < needed:
        raise ValueError(
            f"token_bitmask has {token_bitmask.shape[1]} words per row, padded_vocab_size="
            f"{padded_vocab_size} needs {needed}"
        )
    valid = _valid_word_mask(token_bitmask.shape[1], padded_vocab_size).to(token_bitmask.device)
    dead = ((token_bitmask & valid) == 0).all(dim=1)
    if token_mask is not None:
        if token_mask.shape != (token_bitmask.shape[0],):
            raise ValueError(
                f"token_mask shape {tuple(token_mask.shape)} != ({token_bitmask.shape[0]},)"
            )
        dead &= token_mask.to(token_bitmask.device) != 0
    return dead


def row_is_dead_end(words: np.ndarray, row: int, padded_vocab_size: int) -> bool:
    """:func:`find_dead_end_rows` of one row, on a numpy view of the bitmask (the fill checks every row it fills).

    The same test, bits of ids ``>= padded_vocab_size`` in the last word not
    counted, in a few microseconds: :func:`find_dead_end_rows`'s torch ops on
    one row cost about a hundred.

    Parameters
    ----------
    words : numpy.ndarray
        int32 ``[num_rows, bitmask_size]`` (``token_bitmask.numpy()``), ``bitmask_size >= ceil(padded_vocab_size / 32)``.
    row : int
    padded_vocab_size : int

    Returns
    -------
    bool
        True: the row allows no token below ``padded_vocab_size``.
    """
    full_words, rest = divmod(padded_vocab_size, BITS_PER_WORD)
    if np.count_nonzero(words[row, :full_words]):
        return False
    return not (rest and int(words[row, full_words]) & ((1 << rest) - 1))


def split_bitmask(token_bitmask: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
    """Cut full rows into the word slices each rank applies to its logits shard.

    Parameters
    ----------
    token_bitmask : torch.Tensor
        int32 ``[num_rows, bitmask_size]``.
    tp_size : int

    Returns
    -------
    list of torch.Tensor
        ``tp_size`` contiguous int32 ``[num_rows, bitmask_size // tp_size]`` copies;
        entry ``r`` holds words ``bitmask_shard(bitmask_size, r, tp_size)``.

    Raises
    ------
    ValueError
        ``bitmask_size % tp_size != 0`` (the guard of docs/architecture.md §2).
    """
    bitmask_size = token_bitmask.shape[-1]
    slices = []
    for tp_rank in range(tp_size):
        start, end = bitmask_shard(bitmask_size, tp_rank, tp_size)
        slices.append(token_bitmask[..., start:end].contiguous())
    return slices


def token_ids_to_bitmask_row(token_ids: Iterable[int], vocab_size: int) -> torch.Tensor:
    """A row allowing exactly ``token_ids`` (e.g. the stop tokens of a terminated matcher).

    Returns
    -------
    torch.Tensor
        int32 ``[ceil(vocab_size / 32)]``, CPU.

    Raises
    ------
    ValueError
        An id outside ``[0, vocab_size)``.
    """
    words = [0] * get_bitmask_size(vocab_size)
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"token id {token_id} is outside [0, {vocab_size})")
        words[token_id // BITS_PER_WORD] |= 1 << (token_id % BITS_PER_WORD)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def unpack_bitmask(token_bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool oracle of a bitmask: ``[..., bitmask_size]`` int32 -> ``[..., vocab_size]`` bool (True = allowed)."""
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=token_bitmask.device)
    bits = (token_bitmask.unsqueeze(-1) >> shifts) & 1  # [..., W, 32]
    return bits.flatten(-2)[..., :vocab_size].bool()


def single_allowed_token(row: torch.Tensor, vocab_size: int) -> Optional[int]:
    """The one token a bitmask row allows, or None when it allows none or several.

    Parameters
    ----------
    row : torch.Tensor
        int32 ``[bitmask_size]``, one full row (not a rank's slice), CPU.
    vocab_size : int
        Bits of ids ``>= vocab_size`` do not count.

    Returns
    -------
    int or None
        The token id (the grammar forces it: docs/architecture.md §5, grammar drafts).
    """
    values = row.numpy()  # numpy: the grammar drafter asks once per walked token (a torch op costs ten times more)
    if np.count_nonzero(values) != 1:
        return None
    index = int(values.nonzero()[0][0])
    word = int(values[index]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    token_id = index * BITS_PER_WORD + word.bit_length() - 1
    return token_id if token_id < vocab_size else None


def find_single_token_rows(token_bitmask: torch.Tensor, token_mask: torch.Tensor) -> List[int]:
    """Guided rows that allow exactly one token id: the grammar forces that token (a receipt's count).

    The rows of :func:`single_allowed_token`, all at once: a row with one
    nonzero word whose value is a power of two.  In numpy (a per-row count of
    nonzero words costs microseconds; the torch ops cost a hundred times more
    on a small batch), on the guided rows only.

    Parameters
    ----------
    token_bitmask : torch.Tensor
        int32 ``[num_rows, bitmask_size]``, full rows, CPU.
    token_mask : torch.Tensor
        int32 ``[num_rows]``, CPU; rows with 0 are unguided and never count.

    Returns
    -------
    list of int
        The row indices, ascending.
    """
    rows = np.flatnonzero(token_mask.numpy())
    if not len(rows):
        return []
    words = token_bitmask.numpy()
    single = []
    for row in rows[np.count_nonzero(words[rows], axis=1) == 1]:
        word = int(words[row][np.flatnonzero(words[row])[0]]) & 0xFFFFFFFF
        if not word & (word - 1):
            single.append(int(row))
    return single
