"""Unit partials written into a kept buffer: the same bits as a fresh tensor, one buffer reused, bad ``out`` refused.

A tp > 1 rank's row-parallel layers compute their fp32 unit partials chunk by
chunk into one kept buffer (``parallel_linear.kept_partials``) and write each
chunk's ordered sum into its rows of the layer's output (docs/architecture.md
§6, "Unit partials in a kept buffer").  The tp 2 results are compared with
tp 1 bit for bit in ``tests/multigpu/test_weights_held_once_tp.py`` (chunked)
and ``tests/multigpu/test_chained_units_sum_tp.py``.
"""

from __future__ import annotations

import pytest
import torch

from tpguide.kernels.fixed_order_cpu import linear_fixed_order, pack_weight
from tpguide.model import parallel_linear
from tpguide.model.parallel_linear import kept_partials


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partials_into_out_equal_a_fresh_tensor(dtype):
    x, w = randn(5, 48, seed=1, dtype=dtype), randn(40, 48, seed=2, dtype=dtype)
    packed = pack_weight(w, num_units=3)
    want = linear_fixed_order(x, packed, sum_units=False)
    out = torch.full((3, 5, 40), float("nan"))  # stale values must not show
    got = linear_fixed_order(x, packed, sum_units=False, out=out)
    assert got is out and torch.equal(got, want)
    summed = torch.empty(5, 40, dtype=dtype)
    assert torch.equal(linear_fixed_order(x, packed, out_dtype=dtype, out=summed),
                       linear_fixed_order(x, packed, out_dtype=dtype))


@pytest.mark.parametrize("out,words", [
    (torch.empty(3, 5, 41), "(3, 5, 40)"),
    (torch.empty(3, 5, 40, dtype=torch.bfloat16), "torch.bfloat16"),
    (torch.empty(3, 40, 5).transpose(1, 2), "contiguous: False"),
])
def test_a_bad_out_is_refused_naming_it(out, words):
    packed = pack_weight(randn(40, 48, seed=2), num_units=3)
    with pytest.raises(ValueError, match="out must be") as err:
        linear_fixed_order(randn(5, 48, seed=1), packed, sum_units=False, out=out)
    assert words in str(err.value)


def test_one_buffer_is_kept_for_every_layer_and_a_large_one_is_not(monkeypatch):
    monkeypatch.setattr(parallel_linear, "PARTIALS_CHUNK_BYTES", 4 * 1000)
    first = kept_partials(2, 10, 30)  # 600 floats
    second = kept_partials(4, 5, 20)  # 400 floats: the same storage, another view
    assert tuple(second.shape) == (4, 5, 20) and second.dtype == torch.float32
    assert second.data_ptr() == first.data_ptr()
    big = kept_partials(3, 10, 40)  # 1,200 floats, above the cap: the call's own
    again = kept_partials(3, 10, 40)
    assert big.data_ptr() != first.data_ptr() and again.data_ptr() != first.data_ptr()
    assert kept_partials(1, 10, 60).data_ptr() == first.data_ptr()  # the kept one is still there


def test_sum_units_writes_into_out_and_refuses_a_bad_one():
    from tpguide.dist import TPGroup
    from tpguide.model.invariant_reduce import sum_units

    partials = randn(3, 4, 5, seed=3)
    out = torch.empty(4, 5, dtype=torch.bfloat16)
    got = sum_units(partials, 3, TPGroup(), torch.bfloat16, out=out)
    assert got is out and torch.equal(out, sum_units(partials, 3, TPGroup(), torch.bfloat16))
    with pytest.raises(ValueError, match=r"shape \(4, 5\).*got torch.float32 \(4, 5\)"):
        sum_units(partials, 3, TPGroup(), torch.bfloat16, out=torch.empty(4, 5))
    with pytest.raises(ValueError, match="contiguous: False"):
        sum_units(partials, 3, TPGroup(), torch.float32, out=torch.empty(5, 4).t())
