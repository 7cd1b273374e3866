"""How many KV blocks the ranks allocate: from a byte budget, the same number on every rank (startup).

docs/architecture.md §7 "KV cache".  Every rank holds its KV heads' share of
every block, so a block costs every rank the same bytes
(``model.kv_cache_block_bytes``).  The budget, per rank:

* ``EngineConfig.kv_cache_memory`` bytes when set;
* else on CUDA ``kv_cache_memory_fraction`` of the device's free memory after
  the weights are loaded;
* else (CPU) room for ``max_num_seqs`` requests of ``max_model_len`` tokens
  (plus the speculative lookahead): what the dense per-slot cache took, so
  the defaults never preempt.

The ranks agree on the smallest count (one all-reduce at startup).
"""

from __future__ import annotations

import sys
from typing import Tuple

import torch

from tpguide.dist import TPGroup
from tpguide.dist import group as C


def kv_pool_num_blocks(model, group: TPGroup, config) -> Tuple[int, str]:
    """``(num_blocks, where the budget came from)`` for this engine; the same on every rank (a collective).

    Raises
    ------
    ValueError
        A budget smaller than one block (the message names both in bytes).
    """
    block_bytes = model.kv_cache_block_bytes(config.block_size)
    if config.kv_cache_memory is not None:
        budget, source = config.kv_cache_memory, "--kv-cache-memory"
    elif group.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(group.device)
        budget = int(free * config.kv_cache_memory_fraction)
        source = f"{config.kv_cache_memory_fraction:g} of {free / 2**20:.0f} MiB free"
    else:
        per_request = -(-(config.max_model_len + config.num_speculative_tokens) // config.block_size)
        budget = config.max_num_seqs * per_request * block_bytes
        source = f"default: {config.max_num_seqs} requests x max_model_len {config.max_model_len}"
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget} bytes ({source}) is smaller than one block of "
                         f"{config.block_size} tokens ({block_bytes} bytes on this rank)")
    agreed = C.all_reduce(torch.tensor([num_blocks], dtype=torch.int64, device=group.device), group, op="min")
    return int(agreed.item()), source


def report_kv_pool(num_blocks: int, block_bytes: int, block_size: int, source: str, rank: int = 0) -> None:
    """The startup line (a replica's driver, global ``rank``): blocks, tokens and bytes of the pool on each rank."""
    print(f"[rank {rank}] KV cache: {num_blocks} blocks x {block_size} tokens = {num_blocks * block_size} tokens, "
          f"{num_blocks * block_bytes / 2**20:.1f} MiB per rank ({source})", file=sys.stderr, flush=True)
