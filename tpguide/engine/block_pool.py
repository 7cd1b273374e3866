"""The KV block pool's bookkeeping: reference counts, the prefix-cache map and LRU eviction (driver only).

docs/architecture.md §7 "KV cache".  The ranks hold the blocks' keys and
values; the driver holds only this table of ``num_blocks`` integers and
decides which block every token goes to.  A block is

* **in use** while some request references it (``ref_count > 0``);
* **free** otherwise, in one LRU queue.  A free block that still carries a
  prefix-cache key (:mod:`tpguide.engine.prefix_hash`) keeps its contents and
  can be reused by a later request with the same prefix until it is
  evicted: allocation takes the queue's front, and taking a cached block
  evicts its key.  Freed blocks without a key go to the front (nothing to
  keep), freed cached blocks to the back (evicted last); a request's blocks
  are freed last block first, so a shared prefix outlives its tails.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional, Sequence


class BlockPool:
    """``num_blocks`` KV blocks: who uses them, which are cached, which go first.

    Raises
    ------
    ValueError
        If ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_count: List[int] = [0] * num_blocks
        self.block_hash: List[Optional[bytes]] = [None] * num_blocks
        self.cached: Dict[bytes, int] = {}  # prefix key -> block holding it
        self._free: "OrderedDict[int, None]" = OrderedDict((b, None) for b in range(num_blocks))  # front first

    @property
    def num_free(self) -> int:
        """Blocks no request uses (cached ones included: they are evictable)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def lookup(self, key: bytes) -> Optional[int]:
        """The block cached under ``key``, or None."""
        return self.cached.get(key)

    def allocate(self, n: int) -> List[int]:
        """Take ``n`` free blocks (reference count 1), evicting the cache keys they carried.

        Raises
        ------
        ValueError
            If fewer than ``n`` blocks are free (callers check :attr:`num_free` first).
        """
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} KV blocks: {len(self._free)} of {self.num_blocks} are free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            key = self.block_hash[block]
            if key is not None:  # evict: its contents are about to be overwritten
                del self.cached[key]
                self.block_hash[block] = None
            self.ref_count[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Sequence[int]) -> None:
        """Add a reference to each of ``blocks`` (a prefix-cache hit); a free one leaves the free queue."""
        for block in blocks:
            if self.ref_count[block] == 0:
                del self._free[block]
            self.ref_count[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each of ``blocks``, last block first; unreferenced ones become free."""
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, f"KV block {block} released more often than referenced"
            if self.ref_count[block] == 0:
                self._free[block] = None
                if self.block_hash[block] is None:
                    self._free.move_to_end(block, last=False)  # nothing worth keeping: reuse it first

    def cache(self, block: int, key: bytes) -> None:
        """Register ``block`` (full, final, in use) under ``key``; a key already cached keeps its block."""
        if key not in self.cached and self.block_hash[block] is None:
            self.cached[key] = block
            self.block_hash[block] = key
