"""Single-process tests of vocab-parallel prompt logprobs: shard by hand against log_softmax."""

import pytest
import torch
from sharding import shard_logits

from tpguide.dist.group import TPGroup
from tpguide.model.vocab_shard import VocabShard
from tpguide.sampling.prompt_logprobs import prompt_logprobs_by_hand
from tpguide.sampling.sampler import SamplingMetadata, sample_by_hand
from tpguide.worker.group_sampling import compute_prompt_logprobs

NEG_INF = float("-inf")


def random_case(rows=7, vocab=1001, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 4
    x[torch.rand(rows, vocab, generator=g) < 0.2] = NEG_INF
    targets = torch.randint(0, vocab, (rows,), generator=g)
    x[torch.arange(rows), targets] = torch.randn(rows, generator=g)  # finite targets
    return x, targets


@pytest.mark.parametrize("vocab", [1001, 32011])
def test_matches_log_softmax_and_is_bit_identical_over_tp(vocab):
    full, targets = random_case(vocab=vocab)
    outs = [prompt_logprobs_by_hand(*shard_logits(full, tp)[:1], targets, 5, shard_logits(full, tp)[1])
            for tp in (1, 2, 3, 4)]
    lsm = torch.log_softmax(full.double(), dim=-1)
    want = lsm[torch.arange(full.shape[0]), targets].float()
    torch.testing.assert_close(outs[0].logprobs, want, rtol=0, atol=1e-5)
    order = torch.sort(full, dim=-1, descending=True, stable=True).indices[:, :5]
    assert torch.equal(outs[0].top_ids, order)
    torch.testing.assert_close(outs[0].top_logprobs, lsm.gather(-1, order).float(), rtol=0, atol=1e-5)
    for tp, out in zip((2, 3, 4), outs[1:]):
        assert torch.equal(out.logprobs, outs[0].logprobs), tp
        assert torch.equal(out.top_ids, outs[0].top_ids), tp
        assert torch.equal(out.top_logprobs, outs[0].top_logprobs), tp


def test_equals_the_samplers_logprob_of_the_same_token():
    """Prompt logprobs and sampled-token logprobs share one normaliser: bit-equal."""
    full, _ = random_case(rows=4, vocab=517, seed=3)
    shards_x, shards = shard_logits(full, 2)
    meta = SamplingMetadata(torch.zeros(4), torch.zeros(4, dtype=torch.int32), torch.ones(4),
                            torch.arange(4), torch.zeros(4, dtype=torch.int64), num_logprobs=3)
    sampled = sample_by_hand(shards_x, meta, shards)
    prompt = prompt_logprobs_by_hand(shards_x, sampled.token_ids, 3, shards)
    assert torch.equal(prompt.logprobs, sampled.logprobs)
    assert torch.equal(prompt.top_ids, sampled.top_logprob_ids)
    assert torch.equal(prompt.top_logprobs, sampled.top_logprobs)


def test_bad_rows_give_minus_inf_and_zero_top_is_allowed():
    full, targets = random_case(rows=3, vocab=64)
    full[1] = NEG_INF
    full[2, 5] = float("nan")
    out = compute_prompt_logprobs(*shard_logits(full, 1)[0], targets, 0, VocabShard.create(64, 0, 1), TPGroup())
    assert out.top_ids.shape == (3, 0)
    assert torch.isfinite(out.logprobs[0]) and out.logprobs[1:].eq(NEG_INF).all()


def test_shape_mismatch_names_both_shapes():
    shard = VocabShard.create(64, 0, 1)
    with pytest.raises(ValueError, match=r"\(2, 64\).*\(3, 64\)"):
        compute_prompt_logprobs(torch.zeros(3, 64), torch.zeros(2, dtype=torch.int64), 1, shard, TPGroup())
