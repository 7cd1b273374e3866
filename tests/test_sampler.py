"""Single-process tests of the vocab-parallel sampler: shard by hand, oracle, statistics."""

import math

import pytest
import torch
from sharding import shard_logits

from tpguide.dist.group import TPGroup
from tpguide.model.vocab_shard import VocabShard
from tpguide.sampling import sampler as S
from tpguide.sampling import sampler as sampler_candidates
from tpguide.sampling.random_stream import gumbel_noise
from tpguide.sampling.sampler import SamplingMetadata, local_candidates, merge_candidates, sample_by_hand
from tpguide.worker.group_sampling import sample

NEG_INF = float("-inf")


def make_meta(rows, temperature=1.0, top_k=0, top_p=1.0, seed0=0, position=7, num_logprobs=0):
    def col(v, dtype):
        return torch.as_tensor(v, dtype=dtype).expand(rows).clone() if not isinstance(v, list) else torch.tensor(v, dtype=dtype)

    return SamplingMetadata(
        temperature=col(temperature, torch.float32),
        top_k=col(top_k, torch.int32),
        top_p=col(top_p, torch.float32),
        seeds=torch.arange(seed0, seed0 + rows, dtype=torch.int64) * 1000003 - 12345,
        sample_positions=torch.full((rows,), position, dtype=torch.int64) + torch.arange(rows) % 3,
        num_logprobs=num_logprobs,
    )


def run(full, meta, tp):
    return sample_by_hand(*shard_logits(full, tp)[:1], meta, shard_logits(full, tp)[1])


def random_logits(rows, vocab, seed=0, masked=0.3, quantize=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    if quantize:
        x = torch.round(x * quantize) / quantize  # many ties
    x[torch.rand(rows, vocab, generator=g) < masked] = NEG_INF
    x[:, 0] = torch.where(torch.isinf(x[:, 0]), torch.zeros(()), x[:, 0])  # no all -inf rows
    return x


def reference(full, meta):
    """Plain full-vocabulary sampler (stable sort; shares only the noise function)."""
    tokens, logprobs = [], []
    rows, vocab = full.shape
    ids = torch.arange(vocab)
    for r in range(rows):
        x = full[r].double()
        t, k, p = meta.temperature[r].item(), int(meta.top_k[r]), meta.top_p[r].item()
        if t < S.MIN_TEMPERATURE:
            tok = int(x.argmax())
        else:
            order = torch.sort(x, descending=True, stable=True).indices
            keep_sorted = x[order] > NEG_INF
            if 1 <= k < vocab:
                keep_sorted &= torch.arange(vocab) < k
            if p < 1:
                z = torch.where(keep_sorted, x[order] / t, NEG_INF)
                prob = torch.softmax(z, dim=0)
                before = torch.cumsum(prob, 0) - prob
                keep_sorted &= before < p
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[order[keep_sorted]] = True
            noise = gumbel_noise(meta.seeds[r:r + 1], meta.sample_positions[r:r + 1], ids)[0]
            tok = int(torch.where(keep, x / t + noise, NEG_INF).argmax())
        tokens.append(tok)
        logprobs.append(float(x[tok] - torch.logsumexp(x, 0)))
    return tokens, logprobs


METHODS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top_k": dict(temperature=1.3, top_k=[1, 5, 40, 0, 3, 17]),
    "top_p": dict(temperature=0.9, top_p=[0.5, 0.9, 0.99, 1.0, 0.2, 0.75]),
    "top_k_top_p": dict(temperature=[0.7, 1.0, 2.0, 0.0, 1.0, 0.5], top_k=[10, 0, 50, 5, 3, -1],
                        top_p=[0.8, 0.95, 0.9, 0.5, 1.0, 0.6]),
}


@pytest.mark.parametrize("vocab", [1001, 517])
@pytest.mark.parametrize("method", list(METHODS))
def test_sharded_by_hand_equals_oracle_and_tp1(method, vocab):
    full = random_logits(6, vocab, seed=vocab, quantize=2 if vocab == 517 else None)
    meta = make_meta(6, num_logprobs=4, **METHODS[method])
    want_tokens, want_lp = reference(full, meta)
    outs = [run(full, meta, tp) for tp in (1, 2, 3, 4)]
    assert outs[0].token_ids.tolist() == want_tokens
    torch.testing.assert_close(outs[0].logprobs, torch.tensor(want_lp, dtype=torch.float32), rtol=0, atol=1e-5)
    for tp, out in zip((2, 3, 4), outs[1:]):
        assert torch.equal(out.token_ids, outs[0].token_ids), tp
        assert torch.equal(out.logprobs, outs[0].logprobs), tp  # bit-identical
        assert torch.equal(out.top_logprob_ids, outs[0].top_logprob_ids), tp
        assert torch.equal(out.top_logprobs, outs[0].top_logprobs), tp
        assert not out.bad_rows.any()


def test_top_logprobs_match_log_softmax():
    full = random_logits(5, 301, seed=3, quantize=1)  # ties: lower id first
    out = run(full, make_meta(5, temperature=0.0, num_logprobs=6), 3)
    lsm = torch.log_softmax(full.double(), dim=-1)
    for r in range(5):
        order = torch.sort(full[r], descending=True, stable=True).indices[:6]
        assert out.top_logprob_ids[r].tolist() == order.tolist()
        torch.testing.assert_close(out.top_logprobs[r], lsm[r, order].float(), rtol=0, atol=1e-5)


def test_local_candidates_stack_and_merge_by_hand():
    """The two pure halves: each rank's payload, stacked, merges to the tp 1 winner."""
    full = random_logits(4, 700, seed=9)
    meta = make_meta(4, temperature=[0.0, 1.0, 0.0, 0.5])
    shards1, vs1 = shard_logits(full, 1)
    one = merge_candidates(local_candidates(shards1[0], meta, vs1[0], 8).unsqueeze(0), 8)
    logits, vs = shard_logits(full, 3)
    stacked = torch.stack([local_candidates(x, meta, s, 8) for x, s in zip(logits, vs)])
    assert stacked.shape == (3, 4, 4 + 8)
    merged = merge_candidates(stacked, 8)
    for a, b in zip(one, merged):
        assert torch.equal(a, b)


def test_greedy_ties_pick_lowest_id_across_shards():
    vocab = 700  # tp 2: rank 1 starts at id 384
    full = torch.full((3, vocab), -5.0)
    full[0, [600, 5, 450]] = 2.0  # ties across shards
    full[1, :] = 1.0  # everything tied
    full[2, [650, 400]] = 3.0  # ties inside the last shard
    for tp in (1, 2, 3, 4):
        out = run(full, make_meta(3, temperature=0.0), tp)
        assert out.token_ids.tolist() == [5, 0, 400], tp
    # -0.0 and +0.0 are the same logit: the lower id wins
    z = torch.full((1, 100), -1.0)
    z[0, 70], z[0, 30] = -0.0, 0.0
    assert run(z, make_meta(1, temperature=0.0), 2).token_ids.tolist() == [30]


def test_top_k_boundary_ties_are_tp_invariant():
    full = torch.zeros(2, 500)
    full[:, ::7] = 1.0  # 72 tied maxima spread over every shard
    meta = make_meta(2, temperature=1.0, top_k=5, num_logprobs=5)
    outs = [run(full, meta, tp) for tp in (1, 2, 3, 4)]
    for out in outs:
        assert out.top_logprob_ids.tolist() == [[0, 7, 14, 21, 28]] * 2
        assert torch.equal(out.token_ids, outs[0].token_ids)
        assert set(out.token_ids.tolist()) <= {0, 7, 14, 21, 28}


def test_bad_rows_flagged_never_nan():
    full = random_logits(4, 300, seed=1)
    full[1] = NEG_INF
    full[2, 17] = float("nan")
    full[3, 5] = float("inf")
    for method in ("greedy", "temperature", "top_p"):
        out = run(full, make_meta(4, num_logprobs=2, **{k: v for k, v in METHODS[method].items()
                                                          if not isinstance(v, list)}), 2)
        assert out.bad_rows.tolist() == [False, True, True, True]
        assert out.token_ids[1:].tolist() == [-1, -1, -1]
        assert not torch.isnan(out.logprobs).any()
        assert out.token_ids[0] >= 0


def test_padded_id_winning_is_flagged():
    shard = VocabShard.create(10, 0, 1)  # padded to 64
    x = torch.full((1, 64), NEG_INF)
    x[0, 3], x[0, 40] = 1.0, 9.0  # id 40 >= org_vocab_size: contract broken
    out = sample(x, make_meta(1, temperature=0.0), shard, TPGroup())
    assert out.bad_rows.tolist() == [True] and out.token_ids.tolist() == [-1]


def test_top_p_fallback_grows_candidates(monkeypatch):
    """A flat distribution whose nucleus exceeds the first round stays exact."""
    monkeypatch.setattr(sampler_candidates, "TOP_P_CANDIDATES", 4)
    monkeypatch.setattr(S, "TOP_P_GROWTH", 2)
    full = random_logits(5, 257, seed=4, masked=0.1) * 0.05  # nearly uniform
    meta = make_meta(5, temperature=1.0, top_p=[0.3, 0.9, 0.99, 0.05, 0.6])
    want, _ = reference(full, meta)
    outs = [run(full, meta, tp) for tp in (1, 2, 3, 4)]
    for out in outs:
        assert out.token_ids.tolist() == want
        assert out.num_candidates > 4  # it did grow
        assert out.num_candidates == outs[0].num_candidates


def wilson_hilferty_chi2(df, z=3.09):
    """Chi-square critical value at alpha = 0.001 (Wilson-Hilferty approximation)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(0.7, 0, 1.0), (1.0, 0, 1.0), (2.0, 4, 1.0), (1.0, 0, 0.8), (1.5, 6, 0.7)],
)
def test_chi_square_matches_target_distribution(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, NEG_INF, 0.2, -2.0])
    n = 10000
    meta = make_meta(n, temperature=temperature, top_k=top_k, top_p=top_p, seed0=99)
    out = run(logits.expand(n, -1), meta, 2)
    counts = torch.bincount(out.token_ids, minlength=10).double()
    # target: softmax(logits / T) restricted to top-k then to the nucleus, renormalised
    order = torch.sort(logits, descending=True, stable=True).indices
    keep = torch.isfinite(logits[order])
    if top_k:
        keep &= torch.arange(10) < top_k
    prob = torch.softmax(torch.where(keep, logits[order].double() / temperature, NEG_INF), 0)
    if top_p < 1:
        keep &= (torch.cumsum(prob, 0) - prob) < top_p
    p = torch.zeros(10, dtype=torch.float64)
    p[order[keep]] = prob[keep] / prob[keep].sum()
    assert counts[p == 0].sum() == 0  # nothing outside the kept set
    expected = n * p[p > 0]
    chi2 = float(((counts[p > 0] - expected) ** 2 / expected).sum())
    df = int((p > 0).sum()) - 1
    assert chi2 < wilson_hilferty_chi2(df), (chi2, df, counts.tolist(), expected.tolist())


def test_same_seed_and_position_is_reproducible_and_batch_independent():
    full = random_logits(6, 400, seed=5)
    meta = make_meta(6, temperature=1.0, top_p=0.9)
    whole = run(full, meta, 2).token_ids
    for r in range(6):
        one = SamplingMetadata(
            temperature=meta.temperature[r:r + 1], top_k=meta.top_k[r:r + 1], top_p=meta.top_p[r:r + 1],
            seeds=meta.seeds[r:r + 1], sample_positions=meta.sample_positions[r:r + 1],
        )
        assert run(full[r:r + 1], one, 3).token_ids.item() == whole[r].item()


def test_validation_errors():
    with pytest.raises(ValueError, match="top_p must be in"):
        make_meta(2, top_p=0.0)
    with pytest.raises(ValueError, match="temperature must be finite"):
        make_meta(2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k must be >= -1"):
        make_meta(2, top_k=-3)
    with pytest.raises(TypeError, match="seeds must have dtype"):
        SamplingMetadata(torch.ones(1), torch.zeros(1, dtype=torch.int32), torch.ones(1),
                         torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="sample_positions must be 1-D of shape"):
        SamplingMetadata(torch.ones(2), torch.zeros(2, dtype=torch.int32), torch.ones(2),
                         torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
    shard = VocabShard.create(100, 0, 1)
    with pytest.raises(ValueError, match=r"shape \(2, 128\) \[rows, V_local\], got \(2, 100\)"):
        sample(torch.zeros(2, 100), make_meta(2), shard, TPGroup())
    with pytest.raises(ValueError, match="num_logprobs=101 > org_vocab_size=100"):
        sample(torch.zeros(2, 128), make_meta(2, num_logprobs=101), shard, TPGroup())


@pytest.mark.parametrize("method", sorted(METHODS))
def test_without_logprobs_tokens_are_unchanged(method):
    """``return_logprobs=False`` skips the log-sum-exp pass; the tokens stay the same."""
    from dataclasses import replace

    full = random_logits(6, 1001, seed=4)
    meta = make_meta(6, **METHODS[method])
    for tp in (1, 3):
        with_lp = run(full, meta, tp)
        without = run(full, replace(meta, return_logprobs=False), tp)
        assert torch.equal(without.token_ids, with_lp.token_ids)
        assert torch.isnan(without.logprobs[~without.bad_rows]).all()


def test_device_copy_takes_its_decisions_from_host_data():
    """``meta.to(device)`` keeps the CPU original: modes and ``K`` never read a device tensor back (no host sync).

    The ``meta`` device has no values at all, so any read of one would raise.
    """
    meta = make_meta(4, temperature=[0.0, 1.0, 0.7, 1.0], top_k=[0, 40, 0, 3], top_p=[1.0, 1.0, 0.9, 0.5],
                     num_logprobs=2)
    on_device = meta.to("meta")
    assert on_device.temperature.device.type == "meta" and on_device.on_host is meta
    assert on_device.to("meta").on_host is meta
    modes = S.row_modes(on_device, 1000)
    assert modes.greedy.tolist() == [True, False, False, False] and modes.top_p_on.tolist() == [False, False, True, True]
    assert S.num_candidates(on_device, 1000) == S.TOP_P_CANDIDATES
    assert S.num_candidates(make_meta(2, top_k=[40, 7]).to("meta"), 1000) == 40
