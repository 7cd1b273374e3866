"""The counter-based random stream: reference hash, determinism, sharding, uniformity."""

import math
import struct

import pytest
import torch

from tpguide.sampling.random_stream import gumbel_noise, hash32, uniform_noise


def murmur3_x86_32(data: bytes, seed: int) -> int:
    """Textbook scalar MurmurHash3 x86_32 (the oracle)."""
    m, c1, c2 = 0xFFFFFFFF, 0xCC9E2D51, 0x1B873593

    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & m

    h = seed
    n = len(data) // 4 * 4
    for i in range(0, n, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = rotl((k * c1) & m, 15) * c2 & m
        h = (rotl(h ^ k, 13) * 5 + 0xE6546B64) & m
    tail = data[n:]
    if tail:
        k = int.from_bytes(tail, "little")
        h ^= rotl((k * c1) & m, 15) * c2 & m
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def test_oracle_matches_published_vectors():
    assert murmur3_x86_32(b"", 0) == 0
    assert murmur3_x86_32(b"", 1) == 0x514E28B7
    assert murmur3_x86_32(b"test", 0) == 0xBA6BD213
    assert murmur3_x86_32(b"Hello, world!", 1234) == 0xFAF6CDB3


def test_hash32_is_murmur3_of_the_counter():
    seeds = torch.tensor([0, 123, -5, 2**62 + 7, -(2**63)])
    positions = torch.tensor([0, 1, 99, 2**33 + 1, 2**31 - 1])
    ids = torch.tensor([0, 1, 49151, 151935, 2**32 - 1])
    h = hash32(seeds, positions, ids)
    for r in range(5):
        for c in range(5):
            msg = struct.pack("<qqI", seeds[r].item(), positions[r].item(), ids[c].item())
            assert h[r, c].item() == murmur3_x86_32(msg, 0x9E3779B9)


def test_deterministic_and_sharding_independent():
    seeds = torch.tensor([1, 2, 3, 2**40])
    positions = torch.tensor([10, 10, 11, 0])
    vocab = 1001
    full = gumbel_noise(seeds, positions, torch.arange(vocab))
    assert torch.equal(full, gumbel_noise(seeds, positions, torch.arange(vocab)))
    for start, end in [(0, 1), (5, 17), (384, 768), (1000, 1001), (3, 1001)]:
        part = gumbel_noise(seeds, positions, torch.arange(start, end))
        assert torch.equal(part, full[:, start:end]), (start, end)
    # per-row token ids ([rows, n]) pick the same values as the shared ids
    picks = torch.tensor([[7, 500, 0], [1000, 2, 2], [9, 9, 9], [400, 401, 402]])
    assert torch.equal(gumbel_noise(seeds, positions, picks), full.gather(1, picks))
    # one row alone equals that row of the batch
    assert torch.equal(gumbel_noise(seeds[2:3], positions[2:3], torch.arange(vocab)), full[2:3])
    # seed, position and token each change the noise
    assert not torch.equal(full[0], full[1]) and not torch.equal(full[1], full[2])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_uniform_in_open_interval_and_roughly_uniform(dtype):
    rows, vocab = 64, 2048
    u = uniform_noise(torch.arange(rows) * 7919, torch.arange(rows) % 5, torch.arange(vocab), dtype=dtype)
    assert u.dtype == dtype and u.shape == (rows, vocab)
    assert bool((u > 0).all() and (u < 1).all())
    x = u.double().flatten()
    n = x.numel()
    assert abs(x.mean().item() - 0.5) < 4 * math.sqrt(1 / 12 / n)
    assert abs(x.var().item() - 1 / 12) < 0.002
    # Kolmogorov-Smirnov statistic against U(0, 1); critical value at alpha = 0.001
    xs = torch.sort(x).values
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = torch.maximum(i / n - xs, xs - (i - 1) / n).max().item()
    assert d < 1.95 / math.sqrt(n), d
    # neighbouring tokens and neighbouring positions are uncorrelated
    assert abs(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]).double())[0, 1]) < 0.01
    assert abs(torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]).double())[0, 1]) < 0.01


def test_extreme_uniforms_stay_open():
    # the largest and smallest hash values map strictly inside (0, 1)
    for dtype, top in ((torch.float64, 2**32 - 1), (torch.float32, (2**32 - 1) >> 9)):
        scale = 2.0**-32 if dtype == torch.float64 else 2.0**-23
        hi = torch.tensor((top + 0.5) * scale, dtype=dtype)
        lo = torch.tensor(0.5 * scale, dtype=dtype)
        assert 0 < lo.item() and hi.item() < 1


def test_gumbel_moments_and_bad_dtype():
    g = gumbel_noise(torch.arange(32), torch.zeros(32, dtype=torch.int64), torch.arange(4096))
    assert torch.isfinite(g).all()
    assert abs(g.mean().item() - 0.5772156649) < 0.02  # Euler-Mascheroni
    assert abs(g.var().item() - math.pi**2 / 6) < 0.05
    with pytest.raises(ValueError, match="dtype must be torch.float64 or torch.float32, got torch.float16"):
        uniform_noise(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.arange(3),
                      dtype=torch.float16)
