"""The fused element-wise kernels and the bf16 stores of the fixed-order CPU library, bit for bit
against the plain-torch expressions they replace (docs/architecture.md §6).

Every check is ``torch.equal`` on the outputs (NaN handled separately: NaN stays NaN).  The
data are sensitive: a rounding point moved (a bf16 product not rounded, a sum in the other
order) changes some element, which :func:`test_the_data_tell_the_rounding_points_apart` shows.
"""

from __future__ import annotations

import pytest
import torch

from tpguide.kernels import fixed_order_cpu
from tpguide.kernels.fixed_order_cpu import (
    attention_fixed_order,
    linear_fixed_order,
    mean_square_fixed_order,
    pack_weight,
    unary_fixed_order,
)
from tpguide.kernels.fused_cpu import act_and_mul, fused_add_rms_norm, rotary_fixed_order
from tpguide.model.rotary import rotate_half

DTYPES = [torch.float32, torch.bfloat16]
TOKENS = [1, 3, 8, 33]


@pytest.fixture(autouse=True)
def every_thread(monkeypatch):
    """Small tensors take the threaded path too (``threads_for`` gives them one thread otherwise)."""
    monkeypatch.setattr(fixed_order_cpu, "ELEMENTS_PER_THREAD", 1)


def test_threads_for_caps_small_work_at_one_thread(monkeypatch):
    monkeypatch.setattr(fixed_order_cpu, "ELEMENTS_PER_THREAD", 16384)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert [fixed_order_cpu.threads_for(n) for n in (0, 8 * 576, 32767, 32768, 10 ** 6)] == [1, 1, 1, 2, 2]
    finally:
        torch.set_num_threads(before)
HIDDEN = [576, 101]  # SmolLM2-135M's hidden size, and a width that is no multiple of 16


def randn(*shape, seed=0, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def norm_reference(x, residual, weight, eps):
    """The unfused path: ``h = x + residual``, then RMSNorm with the fixed-order mean square."""
    h = x if residual is None else x + residual
    hf = h.float()
    ms = mean_square_fixed_order(hf.reshape(-1, hf.shape[-1])).view(*hf.shape[:-1], 1)
    return weight * (hf * torch.rsqrt(ms + eps)).to(h.dtype), h


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("d", HIDDEN)
def test_fused_add_rms_norm_equals_add_then_rmsnorm(dtype, t, d):
    x, res = randn(t, d, seed=1, dtype=dtype, scale=3.0), randn(t, d, seed=2, dtype=dtype, scale=40.0)
    w = randn(d, seed=3, dtype=dtype)
    for residual in (res, None):
        out, h = fused_add_rms_norm(x, residual, w, 1e-5)
        want, want_h = norm_reference(x, residual, w, 1e-5)
        assert out.dtype == dtype and torch.equal(out, want) and torch.equal(h, want_h)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_per_head_and_thread_count(dtype):
    """``[T, H, D]`` (Qwen3's q/k norms) on a strided view; 1 and 2 threads agree."""
    qkv = randn(5, 7 * 40, seed=4, dtype=dtype)
    q = qkv[:, :4 * 40].unflatten(-1, (4, 40))  # a non-contiguous view, as qkv_proj.split gives
    w = randn(40, seed=5, dtype=dtype)
    want, _ = norm_reference(q, None, w, 1e-6)
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(fused_add_rms_norm(q, None, w, 1e-6)[0], want)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize(("inter", "op"), [(1536, "silu"), (101, "silu"), (77, "gelu_tanh")])
def test_act_and_mul_equals_activation_cast_times_up(dtype, t, inter, op):
    gate_up = randn(t, 2 * inter, seed=6, dtype=dtype, scale=4.0)
    gate, up = gate_up.chunk(2, dim=-1)
    want = unary_fixed_order(gate, op).to(dtype) * up
    got = act_and_mul(gate_up, op)
    assert got.dtype == dtype and torch.equal(got, want)


def rotary_reference(x, cos, sin):
    """RotaryEmbedding.forward's expression for one tensor ``[T, H, D]``, ``cos``/``sin`` ``[T, 1, R]``."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


def cos_sin(t, r, dtype, seed=7):
    angles = randn(t, r // 2, seed=seed, scale=30.0)
    emb = torch.cat((angles, angles), dim=-1)
    return (emb.cos() * 1.1)[:, None, :].to(dtype), (emb.sin() * 1.1)[:, None, :].to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize(("d", "r"), [(64, 64), (40, 30), (96, 72)])
def test_rotary_equals_rotate_half_expression(dtype, t, d, r):
    qkv = randn(t, (6 + 2 * 2) * d, seed=8, dtype=dtype, scale=5.0)
    q, k, _ = qkv.split([6 * d, 2 * d, 2 * d], dim=-1)
    q, k = q.unflatten(-1, (-1, d)), k.unflatten(-1, (-1, d))  # strided views of the linear output
    cos, sin = cos_sin(t, r, dtype)
    got_q, got_k = rotary_fixed_order(q, k, cos, sin)
    assert torch.equal(got_q, rotary_reference(q, cos, sin)) and torch.equal(got_k, rotary_reference(k, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", TOKENS)
def test_rotary_writes_k_and_v_into_the_cache_rows(dtype, t):
    d, hkv, blocks, block_size = 64, 2, 6, 16
    k, v = randn(t, hkv, d, seed=9, dtype=dtype), randn(t, hkv, d, seed=10, dtype=dtype)
    q = randn(t, 4, d, seed=11, dtype=dtype)
    cos, sin = cos_sin(t, d, dtype)
    rows = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(12))[:t]
    k_cache, v_cache = randn(blocks, block_size, hkv, d, seed=13, dtype=dtype), torch.zeros(blocks, block_size, hkv, d,
                                                                                             dtype=dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k.view(-1, hkv, d)[rows] = rotary_reference(k, cos, sin)
    want_v.view(-1, hkv, d)[rows] = v
    got_q, got_k = rotary_fixed_order(q, k, cos, sin, v, k_cache, v_cache, rows)
    assert got_k is k_cache and torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(got_q, rotary_reference(q, cos, sin))
    with pytest.raises(ValueError, match=r"cache rows must lie in \[0, 96\)"):
        rotary_fixed_order(q, k, cos, sin, v, k_cache, v_cache, rows + blocks * block_size)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize(("n", "k", "units"), [(576, 576, 1), (101, 576, 1), (576, 1536, 12), (70, 192, 3)])
def test_linear_bf16_store_equals_fp32_result_cast(t, n, k, units):
    x, w = randn(t, k, seed=14, dtype=torch.bfloat16), randn(n, k, seed=15, dtype=torch.bfloat16, scale=0.05)
    packed = pack_weight(w, units)
    got = linear_fixed_order(x, packed, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, linear_fixed_order(x, packed).to(torch.bfloat16))
    with pytest.raises(ValueError, match="out_dtype"):
        linear_fixed_order(x, packed, sum_units=False, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_bf16_store_equals_fp32_result_cast(dtype):
    lens, kv_heads, d = [9, 1, 33], 3, 64
    kc, vc = randn(3, 40, kv_heads, d, seed=16, dtype=dtype), randn(3, 40, kv_heads, d, seed=17, dtype=dtype)
    slots = torch.tensor([s for s, n in enumerate(lens) for _ in range(n)])
    pos = torch.tensor([p for n in lens for p in range(n)])
    q = randn(len(slots), 9, d, seed=18, dtype=dtype)
    tables = torch.arange(3)[:, None]
    fp32 = attention_fixed_order(q, kc, vc, tables, slots, pos, 0.125)
    got = attention_fixed_order(q, kc, vc, tables, slots, pos, 0.125, out_dtype=torch.bfloat16, max_seq_len=33)
    assert torch.equal(got, fp32.to(torch.bfloat16))
    with pytest.raises(ValueError, match="max_seq_len=32"):
        attention_fixed_order(q, kc, vc, tables, slots, pos, 0.125, max_seq_len=32)


def test_bf16_store_rounds_ties_to_even_and_keeps_inf_and_nan():
    """Ties, the largest finite values (rounding up to inf), subnormals, inf and NaN, through every store."""
    specials = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 3.3895e38, -3.3895e38, 1e-40,
                             float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    ones = torch.ones(40, 1)  # K = 1: each output is fmaf(x, 1, 0) = x exactly, so the store alone rounds
    got = linear_fixed_order(specials[:, None], pack_weight(ones), out_dtype=torch.bfloat16)
    want = (specials[:, None] * ones.T).to(torch.bfloat16)
    nan = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan)
    assert torch.equal(got[~nan], want[~nan])


def test_the_data_tell_the_rounding_points_apart():
    """The bf16 cases above would fail if a kernel rounded at other points: each variant differs somewhere."""
    t, d = 33, 576
    x, res = randn(t, d, seed=1, dtype=torch.bfloat16, scale=3.0), randn(t, d, seed=2, dtype=torch.bfloat16,
                                                                         scale=40.0)
    w = randn(d, seed=3, dtype=torch.bfloat16)
    want, _ = norm_reference(x, res, w, 1e-5)
    h = (x.float() + res.float())  # the residual sum not rounded to bf16
    ms = mean_square_fixed_order(h)
    assert not torch.equal((w * (h * torch.rsqrt(ms + 1e-5)).to(torch.bfloat16)), want)
    hb = (x + res).float()  # the normalised value not rounded before the weight
    assert not torch.equal((w.float() * (hb * torch.rsqrt(mean_square_fixed_order(hb) + 1e-5))).to(torch.bfloat16),
                           want)
    gate_up = randn(t, 2 * 1536, seed=6, dtype=torch.bfloat16, scale=4.0)
    gate, up = gate_up.chunk(2, dim=-1)
    assert not torch.equal((unary_fixed_order(gate, "silu") * up.float()).to(torch.bfloat16), act_and_mul(gate_up))
    q = randn(t, 6, 64, seed=8, dtype=torch.bfloat16, scale=5.0)
    cos, sin = cos_sin(t, 64, torch.bfloat16)
    fp32_sum = (q.float() * cos.float() + rotate_half(q).float() * sin.float()).to(torch.bfloat16)
    assert not torch.equal(fp32_sum, rotary_fixed_order(q, q[:, :2], cos, sin)[0])


def test_fused_kernels_reject_bad_inputs():
    x = randn(3, 16)
    with pytest.raises(ValueError, match="must be a float32 or bfloat16 CPU tensor"):
        fused_add_rms_norm(x.half(), None, randn(16).half(), 1e-6)
    with pytest.raises(ValueError, match="do not match"):
        fused_add_rms_norm(x, None, randn(15), 1e-6)
    with pytest.raises(ValueError, match="op must be one of"):
        act_and_mul(x, "relu")
    with pytest.raises(ValueError, match=r"\[T, 2 \* I\]"):
        act_and_mul(randn(3, 15))
    with pytest.raises(ValueError, match="do not match"):
        rotary_fixed_order(randn(3, 2, 16), randn(3, 1, 16), randn(3, 15), randn(3, 15))
    with pytest.raises(ValueError, match="need a k_cache"):
        rotary_fixed_order(randn(3, 2, 16), randn(3, 1, 16), randn(3, 16), randn(3, 16), v=randn(3, 1, 16))
