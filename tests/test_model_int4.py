"""GGUF Q4_0 / Q4_1 blocks as torch int4 group-32 weights (tpguide.model.int4_linear)."""

import numpy as np
import pytest
import torch

from tpguide.model.int4_linear import GROUP_SIZE, Int4Weight, dequantize_int4, gguf_q4_to_int4, shard_int4

gguf = pytest.importorskip("gguf")


def _random_blocks(qtype, n, k, seed=0):
    """Quantize random weights with gguf's own reference quantizer; returns (raw blocks, its dequantization)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    data = gguf.quants.quantize(w, kind)
    return data, gguf.quants.dequantize(data, kind)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_conversion_is_exact_against_gguf_dequantize(qtype):
    data, want = _random_blocks(qtype, 48, 96)
    q, scale, zero = gguf_q4_to_int4(data, qtype, 96)
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15
    assert torch.equal(dequantize_int4(q, scale, zero), torch.from_numpy(want))  # bit for bit, fp32


def test_the_embedded_model_file_is_q4_1_and_converts_exactly():
    from tpguide.model.default_model import find_default_gguf

    try:
        reader = gguf.GGUFReader(str(find_default_gguf()))
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert t.tensor_type.name == "Q4_1"
    k = int(t.shape[0])
    q, scale, zero = gguf_q4_to_int4(t.data, "Q4_1", k)
    assert torch.equal(dequantize_int4(q, scale, zero), torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_int4_kernel_matches_dequantized_weights(qtype):
    data, _ = _random_blocks(qtype, 64, 128, seed=1)
    q, scale, zero = gguf_q4_to_int4(data, qtype, 128)
    weight = Int4Weight(q, scale, zero)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    w_bf16_groups = dequantize_int4(q, scale.bfloat16(), zero.bfloat16())  # what the kernel multiplies by
    want = x.bfloat16().double() @ w_bf16_groups.double().T
    got = weight.matmul(x)
    assert got.dtype == torch.float32 and got.shape == (5, 64)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)  # bf16 output rounding


def test_shards_fall_on_group_boundaries():
    data, _ = _random_blocks("Q4_1", 8, 128, seed=3)
    q, scale, zero = gguf_q4_to_int4(data, "Q4_1", 128)
    full = dequantize_int4(q, scale, zero)
    for tp in (2, 4):
        k = 128 // tp
        parts = [dequantize_int4(*shard_int4(q, scale, zero, 1, r * k, k)) for r in range(tp)]
        assert torch.equal(torch.cat(parts, 1), full)
    assert torch.equal(dequantize_int4(*shard_int4(q, scale, zero, 0, 2, 3)), full[2:5])
    with pytest.raises(ValueError, match="group boundary"):
        shard_int4(q, scale, zero, 1, 16, 48)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="qtype"):
        gguf_q4_to_int4(np.zeros((1, 18), np.uint8), "Q5_0", 32)
    with pytest.raises(ValueError, match="k=33"):
        gguf_q4_to_int4(np.zeros((1, 18), np.uint8), "Q4_0", 33)
    with pytest.raises(ValueError, match="bytes each"):
        gguf_q4_to_int4(np.zeros((1, 19), np.uint8), "Q4_0", 32)
    with pytest.raises(ValueError, match="0..15"):
        Int4Weight(torch.full((2, GROUP_SIZE), 16), torch.ones(2, 1), torch.zeros(2, 1))
