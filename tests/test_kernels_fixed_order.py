"""The fixed-order CPU kernels against plain-torch oracles, and the invariances they exist for.

Values: close to an fp64 (or torch) oracle.  Invariances: bit for bit
(``torch.equal``) whatever the other rows, the columns per call, the threads
and the unit split.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpguide.kernels.fixed_order_cpu import (
    attention_fixed_order,
    choose_isa,
    linear_fixed_order,
    mean_square_fixed_order,
    pack_weight,
    sum_units_fixed_order,
    unary_fixed_order,
)

DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def with_threads(n, fn, *args, **kwargs):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 33, 16), (9, 70, 37), (32, 96, 64)])
def test_linear_matches_fp64_oracle(dtype, m, n, k):
    x, w = randn(m, k, seed=1, dtype=dtype), randn(n, k, seed=2, dtype=dtype)
    got = linear_fixed_order(x, pack_weight(w))
    want = (x.double() @ w.double().T).float()
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_row_is_independent_of_other_rows_columns_and_threads(dtype):
    x, w = randn(32, 80, seed=3, dtype=dtype), randn(100, 80, seed=4, dtype=dtype)
    full = linear_fixed_order(x, pack_weight(w))
    for rows in ([5], [0, 5], list(range(3, 11)), list(range(32))[::-1]):  # alone, in batches, any position
        got = linear_fixed_order(x[rows], pack_weight(w))
        assert torch.equal(got, full[rows]), rows
    for lo, hi in ((0, 50), (50, 100), (17, 83)):  # a shard of the output columns
        assert torch.equal(linear_fixed_order(x, pack_weight(w[lo:hi])), full[:, lo:hi])
    assert torch.equal(with_threads(1, linear_fixed_order, x, pack_weight(w)),
                       with_threads(2, linear_fixed_order, x, pack_weight(w)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_units_fused_equal_partials_summed_in_unit_order(dtype):
    x, w = randn(7, 6 * 16, seed=5, dtype=dtype), randn(40, 6 * 16, seed=6, dtype=dtype)
    packed = pack_weight(w, num_units=6)
    partials = linear_fixed_order(x, packed, sum_units=False)  # [6, 7, 40]
    for u in range(6):  # each unit is its own chain over its 16 columns
        assert torch.equal(partials[u], linear_fixed_order(x[:, u * 16:(u + 1) * 16],
                                                           pack_weight(w[:, u * 16:(u + 1) * 16])))
    total = partials[0].clone()
    for u in range(1, 6):
        total += partials[u]  # the unit order, one addition at a time
    assert torch.equal(sum_units_fixed_order(partials), total)
    assert torch.equal(linear_fixed_order(x, packed), total)  # tp 1 adds the units as it goes


def test_linear_rejects_bad_inputs():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        pack_weight(torch.zeros(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="in_features=10 is not divisible by num_units=3"):
        pack_weight(torch.zeros(4, 10), num_units=3)
    with pytest.raises(ValueError, match="x has 5 features, the weight takes 4"):
        linear_fixed_order(torch.zeros(2, 5), pack_weight(torch.zeros(3, 4)))


def _cache_and_queries(dtype, lens, heads=4, kv_heads=2, d=24, length=40, seed=7):
    k_cache, v_cache = randn(len(lens), length, kv_heads, d, seed=seed, dtype=dtype), \
        randn(len(lens), length, kv_heads, d, seed=seed + 1, dtype=dtype)
    slots = torch.tensor([s for s, n in enumerate(lens) for _ in range(n)])
    pos = torch.tensor([p for n in lens for p in range(n)])
    q = randn(len(slots), heads, d, seed=seed + 2, dtype=dtype)
    return q, k_cache, v_cache, slots, pos


def _sdpa_oracle(q, k_cache, v_cache, slots, pos, scale, window=None, softcap=None):
    out = []
    group = q.shape[1] // k_cache.shape[2]
    for t in range(q.shape[0]):
        lo = 0 if window is None else max(0, int(pos[t]) - window + 1)
        keys = k_cache[slots[t], lo:pos[t] + 1].double().repeat_interleave(group, dim=1)  # [J, H, D]
        vals = v_cache[slots[t], lo:pos[t] + 1].double().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,jhd->hj", q[t].double(), keys) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        out.append(torch.einsum("hj,jhd->hd", torch.softmax(s, -1), vals))
    return torch.stack(out).float()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (None, 2.0)])
def test_attention_matches_oracle(dtype, window, softcap):
    q, kc, vc, slots, pos = _cache_and_queries(dtype, [9, 3, 17])
    got = attention_fixed_order(q, kc, vc, slots, pos, 0.2, window, softcap)
    torch.testing.assert_close(got, _sdpa_oracle(q, kc, vc, slots, pos, 0.2, window, softcap), atol=1e-5, rtol=1e-5)


def test_attention_token_is_independent_of_its_batch_and_threads():
    q, kc, vc, slots, pos = _cache_and_queries(torch.bfloat16, [9, 3, 17])
    full = attention_fixed_order(q, kc, vc, slots, pos, 0.2)
    for idx in ([4], [12, 4], [20, 0, 4]):
        assert torch.equal(attention_fixed_order(q[idx], kc, vc, slots[idx], pos[idx], 0.2), full[idx])
    assert torch.equal(with_threads(1, attention_fixed_order, q, kc, vc, slots, pos, 0.2), full)


def test_attention_rejects_positions_outside_the_cache():
    q, kc, vc, slots, pos = _cache_and_queries(torch.float32, [2])
    with pytest.raises(ValueError, match=r"token positions must lie in \[0, 40\)"):
        attention_fixed_order(q, kc, vc, slots, pos + 40, 0.2)


def test_mean_square_and_unary_match_torch_and_do_not_depend_on_size():
    x = randn(33, 150, seed=9) * 3
    torch.testing.assert_close(mean_square_fixed_order(x), x.double().pow(2).mean(-1, keepdim=True).float())
    assert torch.equal(mean_square_fixed_order(x[7:8]), mean_square_fixed_order(x)[7:8])
    oracles = {"silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "cos": torch.cos,
               "sin": torch.sin, "softcap": lambda t: 2.5 * torch.tanh(t / 2.5)}
    for op, oracle in oracles.items():
        got = unary_fixed_order(x, op, 2.5)
        torch.testing.assert_close(got, oracle(x.double()).float(), atol=2e-6, rtol=2e-6)
        assert torch.equal(unary_fixed_order(x.flatten()[5:1234], op, 2.5), got.flatten()[5:1234]), op


def test_choose_isa_caps_by_the_forced_value():
    flags = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}
    assert choose_isa(flags, None) == "avx512"
    assert choose_isa(flags | {"amx_tile", "amx_bf16"}, None) == "amx"
    assert choose_isa(flags | {"amx_tile", "amx_bf16"}, "avx512") == "avx512"
    assert choose_isa(flags, "AVX2") == "avx2"
    assert choose_isa({"avx2", "fma"}, "avx512") == "avx2"
    assert choose_isa(set(), None) == "default"
    with pytest.raises(ValueError, match="ATEN_CPU_CAPABILITY='zen5'"):
        choose_isa(flags, "zen5")
