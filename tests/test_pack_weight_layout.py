"""pack_weight's one-pass packing gives the bytes of the zero-fill-then-permute oracle, for every layout and dtype."""

import pytest
import torch

from tpguide.kernels import fixed_order_cpu
from tpguide.kernels.fixed_order_cpu import PANEL, pack_weight


def oracle_panels(weight, num_units, pair_width):
    """The packing as first written: zeros, the weight copied in, then a permuted contiguous copy.

    ``pair_width``: 0 for the k-major panels, else the k pair layout with units padded to a multiple of it.
    """
    n, k = weight.shape
    unit = k // num_units
    padded_unit = -(-unit // pair_width) * pair_width if pair_width else unit
    num_panels = -(-n // PANEL)
    padded = weight.new_zeros(num_panels * PANEL, num_units, padded_unit)
    padded[:n, :, :unit] = weight.reshape(n, num_units, unit)
    if pair_width:
        return padded.view(num_panels, PANEL, num_units, padded_unit // 2, 2).permute(2, 0, 3, 1, 4).contiguous()
    return padded.view(num_panels, PANEL, num_units, unit).permute(2, 0, 3, 1).contiguous()


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _weight(n, k, dtype, column_major, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(k, n, generator=g).t() if column_major else torch.randn(n, k, generator=g)
    w = w.to(dtype)
    flat = w.t() if column_major else w  # contiguous, to plant special values
    flat.view(-1)[::7] = -0.0
    flat.view(-1)[3::11] = float("nan")
    return w


@pytest.fixture
def nan_filled_empty(monkeypatch):
    """``new_empty`` returns NaN-filled memory, so an element pack_weight forgot to write shows."""
    real = torch.Tensor.new_empty

    def poisoned(self, size, **kw):
        return real(self, size, **kw).fill_(float("nan"))

    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned)


@pytest.mark.parametrize("dtype,isa", [(torch.float32, "avx2"), (torch.bfloat16, "avx2"), (torch.bfloat16, "amx"),
                                       (torch.bfloat16, "avx512_bf16"), (torch.float32, "avx512_bf16")],
                         ids=["fp32", "bf16", "bf16-amx-pairs", "bf16-vdpbf16ps-pairs", "fp32-on-avx512_bf16"])
@pytest.mark.parametrize("column_major", [False, True], ids=["row-major", "column-major"])
@pytest.mark.parametrize("n,k,units", [(96, 64, 1), (70, 48, 3), (31, 40, 1), (576, 576, 9), (33, 90, 2)])
def test_pack_weight_bits_equal_the_oracle(dtype, column_major, n, k, units, isa, monkeypatch, nan_filled_empty):
    monkeypatch.setattr(fixed_order_cpu, "kernel_isa", lambda: isa)  # layout only, no kernel
    w = _weight(n, k, dtype, column_major, seed=n * k + units)
    packed = pack_weight(w, units)
    pair_width = {"amx": 32, "avx512_bf16": 2}.get(isa, 0) if dtype == torch.bfloat16 else 0
    want = oracle_panels(w, units, pair_width)
    assert packed.panels.dtype == dtype and packed.panels.shape == want.shape and packed.panels.is_contiguous()
    assert packed.amx == (pair_width == 32) and packed.pairs == (pair_width == 2)
    assert packed.out_features == n and packed.num_units == units
    assert torch.equal(_bits(packed.panels), _bits(want))  # bit for bit: -0.0 and NaN payloads included


def test_pack_weight_no_rows():
    packed = pack_weight(torch.zeros(0, 8), 2)
    assert packed.panels.shape == (2, 0, 4, PANEL)
