"""The row-parallel sums passed rank to rank (``chained_units_sum``) give tp 1's logits bit for bit at tp 2, 3, 4.

Every CPU step at tp > 1 chains; at tp 4 the 9-head model has zero-padded
heads, whose units the chain skips.  The per-op
path and the decoder stack's half-layer calls both go through it.
"""

import pytest
import torch
from decoder_steps import STEPS, run_steps

from tpguide.dist import TPGroup
from tpguide.dist.spawn import run_on_ranks
from tpguide.model.loader import load_model


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
    out = [logits.numpy() for logits in run_steps(model)]
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
