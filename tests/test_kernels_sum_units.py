"""The one-launch TP-invariant unit sum against its plain-torch oracle: clone, in-place adds in unit order, ``.to``.

On CPU the kernel runs under ``TRITON_INTERPRET=1`` in a child process
(``tests/triton_interpreted.py``); with a GPU the cases also run compiled.
Checks, bit for bit (integer views): every output dtype and unit count,
values that round to bf16 ties and overflow to inf, ``-0.0``; a row alone
equals the row among others; units taken from a larger buffer (the real
units of a padded all-gather); and the errors it raises.

Run directly with ``TRITON_INTERPRET=1 python tests/test_kernels_sum_units.py [NAME...]``.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreted import check_in_child, run_cases

pytest.importorskip("triton")


def _oracle(partials, out_dtype):
    total = partials[0].clone()
    for u in range(1, partials.shape[0]):
        total += partials[u]
    return total.to(out_dtype)


def _same_bits(got, want):
    """Equal bit for bit (integer views), except that a NaN only has to be a NaN (its payload is not compared)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    nan = want.isnan()
    assert torch.equal(nan, got.isnan())
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[got.dtype]
    assert torch.equal(torch.where(nan, 0, got).cpu().view(view), torch.where(nan, 0, want).cpu().view(view))


def _partials(units, tokens, features, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(units, tokens, features, generator=g) * torch.logspace(-3, 3, features)
    p[0, 0, :4] = torch.tensor([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, -0.0, 3.0e38])  # bf16 ties, -0.0, overflow
    if units > 1:
        p[1:, 0, 2] = -0.0  # -0.0 + -0.0 stays -0.0
        p[1, 0, 3] = 3.0e38  # fp32 overflow to inf
        if tokens > 1:
            p[0, 1, 0], p[1, 1, 0] = float("inf"), float("-inf")  # a NaN (compared by its place below)
    return p


def _units(out_dtype, units, tokens, features):
    def case(device):
        from tpguide.kernels.sum_units_triton import sum_units_triton
        p = _partials(units, tokens, features, seed=units * 100 + tokens).to(device)
        got = sum_units_triton(p, out_dtype)
        _same_bits(got, _oracle(p, out_dtype))
        for rows in ([tokens - 1], [0, tokens - 1]):  # a row alone, or beside one other: the same bits
            _same_bits(sum_units_triton(p[:, rows].contiguous(), out_dtype), got[rows])
    return case


def _padded_gather(device):
    """The real units of a padded all-gather ``[tp * U_local, T, O]``: a leading slice, units at their own stride."""
    from tpguide.kernels.sum_units_triton import sum_units_triton
    gathered = _partials(12, 5, 200, seed=7).to(device)
    real = gathered[:9]
    _same_bits(sum_units_triton(real, torch.bfloat16), _oracle(real, torch.bfloat16))
    spaced = torch.zeros(9, 2, 5, 200, device=device)[:, 0]  # units 2 * T * O apart
    spaced.copy_(real)
    _same_bits(sum_units_triton(spaced, torch.float32), _oracle(real, torch.float32))


def _errors(device):
    from tpguide.kernels.sum_units_triton import sum_units_triton
    p = torch.zeros(3, 4, 8, device=device)
    for bad, words in ((p.double(), "fp32"), (p[0], "fp32"), (p[:0], "U >= 1"),
                       (p.transpose(1, 2), "contiguous")):
        with pytest.raises(ValueError, match=words):
            sum_units_triton(bad)
    with pytest.raises(ValueError, match="int32"):
        sum_units_triton(p, torch.int32)
    assert sum_units_triton(p[:, :0]).shape == (0, 8)


CASES = {
    **{f"units_{dt}_{u}_{t}x{o}": _units(getattr(torch, dt), u, t, o)
       for dt, u, t, o in (("float32", 1, 3, 40), ("bfloat16", 1, 3, 40), ("float32", 9, 7, 576),
                           ("bfloat16", 9, 7, 576), ("bfloat16", 12, 33, 576), ("float16", 12, 4, 300),
                           ("bfloat16", 2, 1, 1500))},
    "padded_gather": _padded_gather,
    "errors": _errors,
}


def test_sum_units_interpreted_on_cpu():
    check_in_child(__file__, list(CASES))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_sum_units_cuda(name):
    CASES[name]("cuda")


if __name__ == "__main__":
    run_cases(CASES)
