"""The greedy shortcut (tp 1, every row greedy, no logprobs) gives the vocab-parallel sampler's output bit for bit.

Oracle: :func:`tpguide.sampling.sampler.sample_with_exchange` over one shard
(the general candidate protocol).  Rows with ties (the lowest id wins),
``-0.0`` tied with ``+0.0``, a NaN, ``+inf``, every word masked to ``-inf``,
a padded id holding the maximum (bad), bf16 and fp32 logits; through
:func:`tpguide.worker.group_sampling.sample` at tp 1, and the steps that must
not take it (a sampled row, logprobs asked, tp 2).
"""

from __future__ import annotations

import pytest
import torch

from tpguide.dist import TPGroup
from tpguide.model.vocab_shard import VocabShard
from tpguide.sampling.exchange import ShardsByHand
from tpguide.sampling.greedy import greedy_sample, takes_greedy_shortcut
from tpguide.sampling.sampler import SamplingMetadata, sample_with_exchange
from tpguide.worker.group_sampling import sample

ORG_VOCAB = 1000  # padded to 1024 at tp 1


def _meta(rows, temperature=0.0, num_logprobs=0, return_logprobs=False):
    return SamplingMetadata(temperature=torch.full((rows,), temperature), top_k=torch.zeros(rows, dtype=torch.int32),
                            top_p=torch.ones(rows), seeds=torch.arange(rows), sample_positions=torch.arange(rows) + 3,
                            num_logprobs=num_logprobs, return_logprobs=return_logprobs)


def _logits(shard, dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, shard.num_embeddings_per_partition, generator=g) * 3
    x[:, ORG_VOCAB:] = float("-inf")  # padded ids, as the LM head leaves them
    x[1, [7, 300, 999]] = 50.0  # a three-way tie: id 7 wins
    x[2] = float("-inf")
    x[2, [40, 41]] = torch.tensor([-0.0, 0.0])  # -0.0 and +0.0 tie: id 40 wins
    x[3, 500] = float("nan")
    x[4, 12] = float("inf")
    x[5] = float("-inf")  # every word masked
    x[6, 1010] = 80.0  # a padded id holds the maximum: a bad row
    x[7, 0] = 60.0  # the first column wins
    x[8, ORG_VOCAB - 1] = 60.0  # the last real word wins
    return x.to(dtype)


def _same(got, want):
    for name in ("token_ids", "bad_rows", "top_logprob_ids", "top_logprobs"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (name, a, b)
    assert got.logprobs.dtype == want.logprobs.dtype
    assert torch.equal(got.logprobs.isnan(), want.logprobs.isnan())
    assert torch.equal(got.logprobs.nan_to_num(0.0), want.logprobs.nan_to_num(0.0))
    assert got.num_candidates == want.num_candidates


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_shortcut_equals_the_candidate_protocol(dtype):
    shard = VocabShard.create(ORG_VOCAB, 0, 1)
    x, meta = _logits(shard, dtype), _meta(9)
    want = sample_with_exchange(ShardsByHand([x], [shard]), meta, shard)
    assert want.token_ids.tolist() == [want.token_ids[0].item(), 7, 40, -1, -1, -1, -1, 0, ORG_VOCAB - 1]
    assert takes_greedy_shortcut(meta, shard)
    _same(greedy_sample(x, shard), want)
    _same(sample(x, meta, shard, TPGroup()), want)  # the entry point takes it


def test_steps_that_do_not_take_the_shortcut():
    tp1, tp2 = VocabShard.create(ORG_VOCAB, 0, 1), VocabShard.create(ORG_VOCAB, 0, 2)
    assert not takes_greedy_shortcut(_meta(3, num_logprobs=2), tp1)
    assert not takes_greedy_shortcut(_meta(3, return_logprobs=True), tp1)
    assert not takes_greedy_shortcut(_meta(3, temperature=0.7), tp1)
    mixed = _meta(3)
    mixed.temperature[1] = 0.7  # one sampled row among greedy ones
    assert not takes_greedy_shortcut(mixed, tp1)
    assert not takes_greedy_shortcut(_meta(3), tp2)
    with pytest.raises(ValueError, match="tp-1 shard"):
        greedy_sample(torch.zeros(2, tp2.num_embeddings_per_partition), tp2)
    with pytest.raises(ValueError, match="tp-1 shard"):
        greedy_sample(torch.zeros(2, 5), tp1)
