"""The LM head packed into its own storage (tpguide/model/held_weights.py ``pack_in_place``): the same panels,
bit for bit, as packing it into a new tensor, and nothing written where the panels would not fit."""

import pytest
import torch

from tpguide.kernels.fixed_order_cpu import PACK_CHUNK_ROWS, PANEL, pack_weight
from tpguide.model.held_weights import pack_in_place


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_panels_equal_a_new_packing(dtype):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(PACK_CHUNK_ROWS + 3 * PANEL, 40).to(dtype), requires_grad=False)
    want = pack_weight(weight.detach().clone())
    storage = weight.untyped_storage().data_ptr()
    got = pack_in_place(weight)
    assert got.panels.untyped_storage().data_ptr() == storage  # no second copy of the weight
    assert got.panels.shape == want.panels.shape and torch.equal(got.panels, want.panels)
    assert (got.out_features, got.unit_size, got.num_units, got.padded_unit_size, got.isa) == (
        want.out_features, want.unit_size, want.num_units, want.padded_unit_size, want.isa)


@pytest.mark.parametrize("make", [lambda w: w[:, :32], lambda w: w[: 2 * PANEL - 1], lambda w: w.t()])
def test_weights_whose_panels_do_not_fit_are_left_alone(make):
    base = torch.randn(3 * PANEL, 64)
    view = make(base)
    weight = torch.nn.Parameter(view.contiguous() if view.shape[0] % PANEL else view, requires_grad=False)
    before = weight.detach().clone()
    assert pack_in_place(weight) is None
    assert torch.equal(weight.detach(), before)
