"""Plain-torch oracle of :func:`tpguide.kernels.apply_token_bitmask_inplace`.

Unpacks every bit to a bool, builds the ``[num_rows, width]`` disallowed mask
and calls ``masked_fill_``: slow and memory hungry, written to be obviously
correct.  The tests compare every other backend against it.
"""

from __future__ import annotations

import torch

from tpguide.kernels.bitmask_layout import BITS_PER_WORD


def apply_token_bitmask_inplace_reference(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    *,
    token_mask: torch.Tensor | None = None,
    d2t: torch.Tensor | None = None,
    draft_vocab_start_index: int = 0,
) -> None:
    """Set disallowed logits to ``-inf`` in place, via an unpacked bool mask.

    Arguments are assumed valid (the dispatcher checks them); see
    :func:`tpguide.kernels.apply_token_bitmask_inplace` for the contract.

    Parameters
    ----------
    logits : torch.Tensor
        ``[num_rows, width]`` float32/float16/bfloat16, any strides; written in place.
    bitmask : torch.Tensor
        ``[num_rows, num_words]`` int32 words; bit ``i`` of word ``w`` allows bit
        position ``32*w + i`` of the row (the rank's slice, or the full target row
        with ``d2t``).
    token_mask : torch.Tensor, optional
        ``[num_rows]`` int32; rows where it is 0 are left untouched.
    d2t : torch.Tensor, optional
        ``[width]`` int32 offsets: column ``j`` is draft id
        ``g = draft_vocab_start_index + j`` with target id ``g + d2t[j]``.
    draft_vocab_start_index : int
        First draft id of this shard (tokens).
    """
    num_rows, width = logits.shape
    num_bits = BITS_PER_WORD * bitmask.shape[1]
    device = logits.device
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=device)
    # bits: [num_rows, num_words, 32] -> [num_rows, num_bits]; True = allowed
    bits = ((bitmask.to(device).unsqueeze(-1) >> shifts) & 1).bool().reshape(num_rows, num_bits)

    columns = torch.arange(width, dtype=torch.int64, device=device)
    if d2t is None:
        positions = columns  # column j <-> bit j of the slice
    else:
        positions = draft_vocab_start_index + columns + d2t.to(device, torch.int64)
    in_range = (positions >= 0) & (positions < num_bits)  # [width]

    allowed = torch.zeros(num_rows, width, dtype=torch.bool, device=device)
    if num_bits > 0:
        allowed = bits[:, positions.clamp(0, num_bits - 1)] & in_range
    disallowed = ~allowed  # [num_rows, width]
    if token_mask is not None:
        disallowed &= (token_mask.to(device) != 0).unsqueeze(1)
    logits.masked_fill_(disallowed, float("-inf"))
