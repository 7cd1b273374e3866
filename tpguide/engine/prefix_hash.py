"""Prefix-cache keys of full KV blocks: each block's hash chains its parent's (driver only).

docs/architecture.md §7 "KV cache".  As vLLM's automatic prefix caching: the
key of block ``i`` of a token sequence is ``sha256(key of block i-1 || the
block's token ids)``, so equal keys mean equal *prefixes* up to and including
that block (token ids and positions), hence equal keys and values in the
TP-invariant mode.  Only full blocks get a key; a partial last block never
does.  The KV of a block depends on nothing else here (one model, one dtype
per engine), so the token ids are the whole key.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import List, Sequence

#: The parent of a sequence's first block.
ROOT_HASH = b"tpguide-prefix-root"


def extend_block_hashes(hashes: List[bytes], token_ids: Sequence[int], block_size: int, num_blocks: int) -> List[bytes]:
    """Append the keys of blocks ``len(hashes) .. num_blocks - 1`` of ``token_ids`` to ``hashes`` (in place).

    Parameters
    ----------
    hashes : list of bytes
        Keys of the first blocks (32-byte sha256 digests), extended in place and returned.
    token_ids : sequence of int
        The sequence; must hold at least ``num_blocks * block_size`` tokens.
    block_size : int
        Tokens per block.
    num_blocks : int
        Blocks that should have a key on return (fewer than ``len(hashes)``: nothing changes).

    Raises
    ------
    ValueError
        If ``token_ids`` is shorter than ``num_blocks`` full blocks.
    """
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"{num_blocks} full blocks of {block_size} tokens need {num_blocks * block_size} "
                         f"tokens, the sequence has {len(token_ids)}")
    for i in range(len(hashes), num_blocks):
        block = array("q", token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(hashlib.sha256((hashes[i - 1] if i else ROOT_HASH) + block.tobytes()).digest())
    return hashes
