"""Real gloo runs of the vocab-parallel sampler: every rank equals tp 1, bit for bit."""

import pytest
import torch

from tpguide.dist.group import TPGroup
from tpguide.dist.spawn import run_on_ranks
from tpguide.model.vocab_shard import VocabShard
from tpguide.sampling.sampler import SamplingMetadata
from tpguide.worker.group_sampling import sample

ORG_VOCAB = 1001
ROWS = 6
METHODS = {
    "greedy": dict(temperature=[0.0] * ROWS, top_k=[0] * ROWS, top_p=[1.0] * ROWS),
    "temperature": dict(temperature=[0.6, 1.0, 1.7, 0.9, 1.2, 0.3], top_k=[0] * ROWS, top_p=[1.0] * ROWS),
    "top_k": dict(temperature=[1.0] * ROWS, top_k=[1, 4, 30, 0, 7, 2], top_p=[1.0] * ROWS),
    "top_p": dict(temperature=[0.8, 1.0, 1.5, 1.0, 2.0, 0.7], top_k=[0] * ROWS, top_p=[0.5, 0.9, 0.95, 1.0, 0.99, 0.3]),
    "mixed": dict(temperature=[0.0, 1.0, 0.7, 1.3, 1.0, 0.9], top_k=[5, 0, 20, 0, 3, 0],
                  top_p=[1.0, 0.9, 0.8, 1.0, 1.0, 0.6]),
}


def _logits(padded_vocab_size):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(ROWS, ORG_VOCAB, generator=g) * 2.5
    x[torch.rand(ROWS, ORG_VOCAB, generator=g) < 0.25] = float("-inf")  # a bitmask
    x[:, 1] = 0.5
    out = torch.full((ROWS, padded_vocab_size), float("-inf"))
    out[:, :ORG_VOCAB] = x
    return out


def _meta(method):
    p = METHODS[method]
    return SamplingMetadata(
        temperature=torch.tensor(p["temperature"]),
        top_k=torch.tensor(p["top_k"], dtype=torch.int32),
        top_p=torch.tensor(p["top_p"]),
        seeds=torch.tensor([3, -7, 2**40 + 1, 11, 12, 99], dtype=torch.int64),
        sample_positions=torch.tensor([5, 6, 7, 100, 3, 0], dtype=torch.int64),
        num_logprobs=3,
    )


def _sample_all(group):
    shard = VocabShard.create(ORG_VOCAB, group.tp_rank, group.tp_size)
    logits = _logits(shard.padded_vocab_size)[:, shard.vocab_start_index:shard.vocab_end_index]
    results = {}
    for method in METHODS:
        out = sample(logits.clone(), _meta(method), shard, group)
        fields = (out.token_ids, out.logprobs, out.top_logprob_ids, out.top_logprobs, out.bad_rows)
        results[method] = [t.tolist() for t in fields]  # lists: tensors in the queue outlive no rank
    return results


@pytest.mark.parametrize("tp_size", [2, 3])
def test_sampler_matches_tp1_on_gloo(tp_size):
    want = _sample_all(TPGroup())
    results = run_on_ranks(_sample_all, tp_size)
    for rank, got in enumerate(results):
        for method in METHODS:
            for name, a, b in zip(("tokens", "logprobs", "top ids", "top logprobs", "bad"), got[method], want[method]):
                assert a == b, (tp_size, rank, method, name, a, b)  # float32 -> float is exact
