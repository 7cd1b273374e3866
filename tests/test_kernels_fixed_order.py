"""The fixed-order CPU kernels against plain-torch oracles, and the invariances they exist for.

Values: close to an fp64 (or torch) oracle.  Invariances: bit for bit
(``torch.equal``) whatever the other rows, the columns per call, the threads
and the unit split.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpguide.kernels import fixed_order_cpu
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
    # a running sum carried on (the tp > 1 chain): units 0-2 here, 3-5 on the next rank
    assert torch.equal(sum_units_fixed_order(partials[3:], sum_units_fixed_order(partials[:3])), total)
    assert torch.equal(sum_units_fixed_order(partials[:0], total), total)  # a rank of padded units only
    with pytest.raises(ValueError, match="a unit's shape"):
        sum_units_fixed_order(partials, total[:1])


def test_linear_rejects_bad_inputs():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        pack_weight(torch.zeros(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="in_features=10 is not divisible by num_units=3"):
        pack_weight(torch.zeros(4, 10), num_units=3)
    with pytest.raises(ValueError, match="x has 5 features, the weight takes 4"):
        linear_fixed_order(torch.zeros(2, 5), pack_weight(torch.zeros(3, 4)))


def _cache_and_queries(dtype, lens, heads=4, kv_heads=2, d=24, length=40, seed=7):
    """``q [T, H, D]``, dense caches ``[S, length, Hkv, D]``, per-token slots and positions (whole prompts)."""
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


def _dense(q, kc, vc, slots, pos, *args):
    """The kernel on a dense slot cache: one block of ``max_model_len`` positions per slot."""
    return attention_fixed_order(q, kc, vc, torch.arange(kc.shape[0])[:, None], slots, pos, *args)


def _paged(kc, block_size, seed=3):
    """The dense cache ``[S, L, Hkv, D]`` scattered into shuffled blocks: ``(pool, block_tables)``."""
    s, length = kc.shape[:2]
    per_seq = length // block_size
    perm = torch.randperm(s * per_seq + 5, generator=torch.Generator().manual_seed(seed))[:s * per_seq]
    pool = torch.zeros(s * per_seq + 5, block_size, *kc.shape[2:], dtype=kc.dtype)
    pool[perm] = kc.reshape(s * per_seq, block_size, *kc.shape[2:])
    return pool, perm.view(s, per_seq)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (None, 2.0)])
def test_attention_matches_oracle(dtype, window, softcap):
    q, kc, vc, slots, pos = _cache_and_queries(dtype, [9, 3, 17])
    got = _dense(q, kc, vc, slots, pos, 0.2, window, softcap)
    torch.testing.assert_close(got, _sdpa_oracle(q, kc, vc, slots, pos, 0.2, window, softcap), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("heads", "kv_heads", "d", "window"), [(9, 3, 64, None), (6, 2, 96, 37), (4, 4, 130, None)])
def test_attention_long_sequences_match_oracle(heads, kv_heads, d, window):
    """Several score blocks of 64 keys, head dims past one 64-wide P V block, query groups of 1 and 3."""
    q, kc, vc, slots, pos = _cache_and_queries(torch.float32, [150, 1, 70], heads, kv_heads, d, length=160)
    got = _dense(q, kc, vc, slots, pos, 0.1, window)
    torch.testing.assert_close(got, _sdpa_oracle(q, kc, vc, slots, pos, 0.1, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_paged_equals_dense(dtype):
    q, kc, vc, slots, pos = _cache_and_queries(dtype, [150, 1, 70], 9, 3, 64, length=160)
    kp, tables = _paged(kc, 16)
    vp, tables_v = _paged(vc, 16)
    assert torch.equal(tables, tables_v)
    dense = _dense(q, kc, vc, slots, pos, 0.1, 37)
    assert torch.equal(attention_fixed_order(q, kp, vp, tables, slots, pos, 0.1, 37), dense)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_token_is_independent_of_its_batch_and_threads(dtype):
    q, kc, vc, slots, pos = _cache_and_queries(dtype, [9, 3, 130], 9, 3, 64, length=140)
    full = _dense(q, kc, vc, slots, pos, 0.2)
    for idx in ([4], [12, 4], [20, 0, 4], list(range(12, 12 + 7)), list(range(12 + 100, 142)), [141]):
        assert torch.equal(_dense(q[idx], kc, vc, slots[idx], pos[idx], 0.2), full[idx])
    assert torch.equal(with_threads(1, _dense, q, kc, vc, slots, pos, 0.2), full)
    windowed = _dense(q, kc, vc, slots, pos, 0.2, 21)
    for idx in ([141], list(range(50, 57)), [3, 140]):
        assert torch.equal(_dense(q[idx], kc, vc, slots[idx], pos[idx], 0.2, 21), windowed[idx])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_scratch_kept_between_calls_changes_no_bit(dtype, monkeypatch):
    """The per-thread scratch the kernel reuses across layers (poisoned with NaN, then grown by a
    longer call) gives every call the bits of a scratch of its own (one above the kept size)."""
    q, kc, vc, slots, pos = _cache_and_queries(dtype, [9, 3, 130], 9, 3, 64, length=140)
    monkeypatch.setattr(fixed_order_cpu, "SCRATCH_KEPT_FLOATS", 0)  # every call its own scratch
    fresh_all = _dense(q, kc, vc, slots, pos, 0.2)
    fresh_short = _dense(q[:12], kc, vc, slots[:12], pos[:12], 0.2)
    monkeypatch.setattr(fixed_order_cpu, "SCRATCH_KEPT_FLOATS", 1 << 22)
    _dense(q[:12], kc, vc, slots[:12], pos[:12], 0.2)
    fixed_order_cpu._SCRATCH.buf.fill_(float("nan"))
    assert torch.equal(_dense(q[:12], kc, vc, slots[:12], pos[:12], 0.2), fresh_short)
    assert torch.equal(_dense(q, kc, vc, slots, pos, 0.2), fresh_all)  # grows the kept buffer
    fixed_order_cpu._SCRATCH.buf.fill_(float("nan"))
    assert torch.equal(_dense(q[:12], kc, vc, slots[:12], pos[:12], 0.2), fresh_short)


def test_attention_rejects_positions_outside_the_cache():
    q, kc, vc, slots, pos = _cache_and_queries(torch.float32, [2])
    with pytest.raises(ValueError, match=r"token positions must lie in \[0, 40\)"):
        _dense(q, kc, vc, slots, pos + 40, 0.2)
    with pytest.raises(ValueError, match=r"read blocks in \[0, 1\)"):
        attention_fixed_order(q, kc, vc, torch.tensor([[3]]), slots, pos, 0.2)


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
    assert choose_isa(flags | {"avx512_bf16"}, None) == "avx512_bf16"
    assert choose_isa(flags | {"avx512_bf16", "amx_tile", "amx_bf16"}, "avx512_bf16") == "avx512_bf16"
    assert choose_isa(flags | {"avx512_bf16"}, "avx512") == "avx512"  # the fmaf-chain bf16 tile
    assert choose_isa({"avx2", "fma", "avx512_bf16"}, None) == "avx2"  # no AVX-512 F/BW/VL: no pair tile
    assert choose_isa(flags, "AVX2") == "avx2"
    assert choose_isa({"avx2", "fma"}, "avx512") == "avx2"
    assert choose_isa(set(), None) == "default"
    assert choose_isa(flags, "") == "avx512"  # empty = unset, as torch reads it
    with pytest.raises(ValueError, match="ATEN_CPU_CAPABILITY='zen5'"):
        choose_isa(flags, "zen5")
