"""Which KV blocks each request holds: allocation, prefix-cache hits, caching of final blocks (driver only).

docs/architecture.md §7 "KV cache".  A request's block table
(``Request.block_ids``) lists its blocks in position order: position ``j``
is in ``block_ids[j // block_size]``.  The scheduler asks for blocks before
a step (:meth:`KVCacheManager.allocate`, covering the step's new tokens plus
its draft lookahead), the driver registers the full blocks whose tokens are
final after a step (:meth:`KVCacheManager.cache_final_blocks`), and a
finished or preempted request gives its blocks back (:meth:`KVCacheManager.free`).

Prefix caching (vLLM's automatic prefix caching): a request about to be
prefilled looks up the keys of its full blocks (:mod:`tpguide.engine.prefix_hash`)
and reuses the longest cached run from its start
(:meth:`KVCacheManager.cached_prefix`).  At most ``(num_tokens - 1) //
block_size`` blocks are reused, so the last prompt token is always computed
(its hidden state gives the first sample).  A request that asks for prompt
logprobs reuses nothing: those need the logits of every prompt position.
"""

from __future__ import annotations

from typing import List, Tuple

from tpguide.engine.block_pool import BlockPool
from tpguide.engine.prefix_hash import extend_block_hashes
from tpguide.engine.request import Request


class KVCacheManager:
    """The driver's view of the ranks' KV block pool.

    Parameters
    ----------
    num_blocks : int
        Blocks in the pool (the same on every rank).
    block_size : int
        Tokens per block.
    enable_prefix_caching : bool

    Attributes
    ----------
    pool : BlockPool
    prefix_queries, prefix_hits : int
        Tokens looked up in the prefix cache at admission, and tokens found
        (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def check_fits(self, num_tokens: int, what: str) -> None:
        """Refuse a request that could never fit the pool, even alone.

        Raises
        ------
        ValueError
            If ``num_tokens`` positions need more blocks than the pool has
            (the message names ``what``, the blocks and the pool).
        """
        need = self.blocks_for(num_tokens)
        if need > self.num_blocks:
            raise ValueError(f"{what} = {num_tokens} tokens need {need} KV blocks of {self.block_size} tokens, "
                             f"but the KV cache holds {self.num_blocks} blocks ({self.num_blocks * self.block_size} "
                             f"tokens; raise --kv-cache-memory)")

    def cached_prefix(self, req: Request, num_tokens: int) -> Tuple[List[int], int]:
        """``(blocks, tokens)``: the longest cached run of ``req``'s first ``num_tokens`` tokens' full blocks.

        Nothing is referenced yet (:meth:`allocate` does); ``([], 0)`` with
        prefix caching off or when the request asks for prompt logprobs.
        """
        if not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (num_tokens - 1) // self.block_size  # the last token is always computed
        tokens = req.all_token_ids
        blocks: List[int] = []
        for i in range(max_blocks):
            extend_block_hashes(req.block_hashes, tokens, self.block_size, i + 1)
            block = self.pool.lookup(req.block_hashes[i])
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix lookup (only with prefix caching on)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def allocate(self, req: Request, num_tokens: int, cached_blocks: List[int] = ()) -> bool:
        """Make ``req``'s block table cover ``num_tokens`` positions; False (nothing changed) if the pool is short.

        ``cached_blocks``: a hit of :meth:`cached_prefix`, for a request that holds no blocks yet.
        """
        need = self.blocks_for(num_tokens) - len(req.block_ids) - len(cached_blocks)
        if cached_blocks:  # (a decode step has none: its path is the short one)
            assert not req.block_ids, "a cached prefix is taken only by a request without blocks"
            reclaimed = sum(1 for b in cached_blocks if self.pool.ref_count[b] == 0)  # free now, in use after the touch
            if need > self.pool.num_free - reclaimed:
                return False
            self.pool.touch(cached_blocks)
            req.block_ids.extend(cached_blocks)
            req.num_cached_blocks = len(cached_blocks)  # the hit blocks are cached already
        elif need > self.pool.num_free:
            return False
        # (any other block is cached by cache_final_blocks once full of final tokens, generated ones included)
        if need > 0:
            req.block_ids.extend(self.pool.allocate(need))
        return True

    def cache_final_blocks(self, req: Request) -> None:
        """Register ``req``'s full blocks whose tokens are final and whose KV is written.

        Those are the first ``num_computed_tokens // block_size`` blocks:
        ``num_computed_tokens`` counts the positions written with accepted
        tokens (rejected drafts are not counted), so a block holding a draft
        is never cached.
        """
        if not self.enable_prefix_caching:
            return
        full = min(req.num_computed_tokens, req.num_tokens) // self.block_size
        if full <= req.num_cached_blocks:
            return
        extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size, full)
        for i in range(req.num_cached_blocks, full):
            self.pool.cache(req.block_ids[i], req.block_hashes[i])
        req.num_cached_blocks = full

    def free(self, req: Request) -> None:
        """Give ``req``'s blocks back (cached ones stay reusable until evicted); idempotent."""
        self.pool.release(req.block_ids)
        req.block_ids = []
        req.num_cached_blocks = 0
