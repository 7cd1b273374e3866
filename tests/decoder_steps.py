"""Three forward steps over a shuffled paged cache, for the decoder-stack and chained-sum tests.

A chunked prefill beside a whole prompt, then a decode beside the second chunk
(which crosses blocks), then two decodes; the cache is allocated anew first.
"""

import torch

from tpguide.model.attention import AttentionMetadata

BLOCK = 4
A = [11, 40, 7, 300, 2, 9, 81, 5, 64, 3, 200]
B = [17, 4, 99, 12, 6, 250]
#: Steps of (sequence, context length, token ids).
STEPS = [[(0, 0, A[:7]), (1, 0, B)], [(1, 6, [5]), (0, 7, A[7:])], [(0, 11, [9]), (1, 7, [3])]]
#: Each sequence's blocks: shuffled, not contiguous; blocks 1, 3, 4, 6 unused.
TABLES = {0: [7, 2, 5], 1: [0, 8]}


def run_steps(model):
    """Yield each step's logits ``[rows, vocab shard]`` (a fresh 9-block cache first)."""
    model.allocate_kv_cache(9, BLOCK, 32)
    for seqs in STEPS:
        q, c = [len(t) for _, _, t in seqs], [ctx for _, ctx, _ in seqs]
        meta = AttentionMetadata.from_block_tables([TABLES[s] for s, _, _ in seqs], q, c, block_size=BLOCK)
        ids = torch.tensor([t for _, _, toks in seqs for t in toks])
        yield model.compute_logits(model(ids, meta.token_positions, meta))
