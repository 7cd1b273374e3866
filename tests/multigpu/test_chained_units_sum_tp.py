"""The row-parallel sums passed rank to rank (``chained_units_sum``) give tp 1's logits bit for bit at tp 2, 3, 4.

Every CPU step at tp > 1 chains; at tp 4 the 9-head model has zero-padded
heads, whose units the chain skips.  The per-op
path and the decoder stack's half-layer calls both go through it.
"""

import pytest
import torch

from tpguide.dist import TPGroup
from tpguide.dist.spawn import run_on_ranks
from tpguide.model.attention import AttentionMetadata
from tpguide.model.loader import load_model

BLOCK = 4
A = [11, 40, 7, 300, 2, 9, 81, 5, 64, 3, 200]
B = [17, 4, 99, 12, 6, 250]
STEPS = [[(0, 0, A[:7]), (1, 0, B)], [(1, 6, [5]), (0, 7, A[7:])], [(0, 11, [9]), (1, 7, [3])]]
TABLES = {0: [7, 2, 5], 1: [0, 8]}


def _logits(group: TPGroup, model_dir: str, stacked: bool):
    from tpguide.model import invariant_reduce

    chained = []
    real = invariant_reduce.chained_units_sum

    def counted(*args, **kwargs):
        chained.append(1)
        return real(*args, **kwargs)

    invariant_reduce.chained_units_sum = counted
    model = load_model(model_dir, group, torch.float32)  # fp32: a changed order of additions shows
    model.model.use_decoder_stack = stacked
    model.allocate_kv_cache(9, BLOCK, 32)
    out = []
    for seqs in STEPS:
        q, c = [len(t) for _, _, t in seqs], [ctx for _, ctx, _ in seqs]
        meta = AttentionMetadata.from_block_tables([TABLES[s] for s, _, _ in seqs], q, c, block_size=BLOCK)
        ids = torch.tensor([t for _, _, toks in seqs for t in toks])
        out.append(model.compute_logits(model(ids, meta.token_positions, meta)).numpy())
    return out, model.vocab_shard.vocab_start_index, len(chained)


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_chained_sums_equal_tp1(tiny_model_path, tp):
    want, _, none = _logits(TPGroup(), tiny_model_path, False)
    assert none == 0  # tp 1 adds its units in the kernel
    layers = load_model(tiny_model_path, TPGroup()).config.num_hidden_layers
    for stacked in (True, False):
        for shards, start, chained in run_on_ranks(_logits, tp, tiny_model_path, stacked):
            assert chained == 2 * layers * len(STEPS)  # every o_proj and down_proj sum went by the chain
            for shard, full in zip(shards, want):
                assert torch.equal(torch.from_numpy(shard), torch.from_numpy(full)[:, start:start + shard.shape[1]])
