"""The fixed-tiling Triton matmul (TP-invariant path on CUDA) against a torch oracle.

As in ``test_kernels_triton.py``, on CPU the kernel runs under
``TRITON_INTERPRET=1`` in a child process (``tests/triton_interpreted.py``);
with a GPU the cases also run on the compiled kernel.  Checks: values
against an fp64 torch matmul, and the invariance the model relies on, bit
for bit: a column shard or a batch slice gives exactly the matching part of
the full result.

Run the interpreted cases directly with
``TRITON_INTERPRET=1 python tests/test_kernels_matmul_fixed_tiling.py``.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreted import check_in_child, run_cases

pytest.importorskip("triton")


def _randn(*shape, dtype, device, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def _against_oracle(batch, m, k, n, dtype, strided):
    def case(device):
        from tpguide.kernels.matmul_fixed_tiling_triton import bmm_fixed_tiling
        a = _randn(batch, m, k, dtype=dtype, device=device, seed=1)
        b = _randn(batch, n, k, dtype=dtype, device=device, seed=2).transpose(1, 2) if strided else \
            _randn(batch, k, n, dtype=dtype, device=device, seed=2)
        got = bmm_fixed_tiling(a, b)
        want = torch.bmm(a.double(), b.double())
        assert got.dtype == torch.float32 and got.shape == (batch, m, n)
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.double(), want, atol=tol * k ** 0.5, rtol=tol)
    return case


def _shard_invariance(m, k, n, dtype):
    def case(device):
        from tpguide.kernels.matmul_fixed_tiling_triton import bmm_fixed_tiling, linear_fixed_tiling
        x, w = _randn(m, k, dtype=dtype, device=device, seed=3), _randn(n, k, dtype=dtype, device=device, seed=4)
        full = linear_fixed_tiling(x, w)
        for tp in (2, 3, 4):
            cols = n // tp
            for r in range(tp):  # column-parallel: a weight shard gives its columns exactly
                assert torch.equal(linear_fixed_tiling(x, w[r * cols:(r + 1) * cols]), full[:, r * cols:(r + 1) * cols])
        units = _randn(12, m, 16, dtype=dtype, device=device, seed=5)
        wu = _randn(12, 16, n, dtype=dtype, device=device, seed=6)
        all_units = bmm_fixed_tiling(units, wu)
        for tp in (2, 3, 4):  # row-parallel units: a rank's units give their partials exactly
            u = 12 // tp
            for r in range(tp):
                part = bmm_fixed_tiling(units[r * u:(r + 1) * u], wu[r * u:(r + 1) * u])
                assert torch.equal(part, all_units[r * u:(r + 1) * u])
        assert torch.equal(linear_fixed_tiling(x[:1], w), full[:1])  # fewer rows: the same row values
    return case


def _out_dtype(dtype, out_dtype):
    """A rounded store: the bits of the fp32 result's ``.to(out_dtype)`` (the column-parallel layers' output)."""
    def case(device):
        from tpguide.kernels.matmul_fixed_tiling_triton import bmm_fixed_tiling, linear_fixed_tiling
        a, b = _randn(2, 9, 70, dtype=dtype, device=device, seed=7), _randn(2, 70, 130, dtype=dtype, device=device,
                                                                            seed=8)
        b[0, :, 0] = 0.0
        b[0, 0, 0], b[0, 1, 0] = 1.0, 3 * 2.0 ** -8  # column 0 of batch 0: 1 + 3 * 2^-8, a bf16 tie rounding up
        a[0, :, :2] = 1.0
        view = torch.int16 if out_dtype != torch.float32 else torch.int32
        rounded = bmm_fixed_tiling(a, b, out_dtype)
        assert rounded.dtype == out_dtype
        assert torch.equal(rounded.view(view), bmm_fixed_tiling(a, b).to(out_dtype).view(view))
        x, w = a[1], b[1].t()
        assert torch.equal(linear_fixed_tiling(x, w, out_dtype).view(view), rounded[1].view(view))
    return case


def _errors(device):
    from tpguide.kernels.matmul_fixed_tiling_triton import bmm_fixed_tiling
    a = torch.zeros(1, 2, 3, device=device)
    for bad in (torch.zeros(1, 4, 5, device=device), torch.zeros(1, 3, 5, device=device, dtype=torch.float16)):
        with pytest.raises(ValueError):
            bmm_fixed_tiling(a, bad)
    with pytest.raises(ValueError, match="out_dtype"):
        bmm_fixed_tiling(a, torch.zeros(1, 3, 5, device=device), torch.int32)
    assert torch.equal(bmm_fixed_tiling(torch.zeros(2, 3, 0, device=device), torch.zeros(2, 0, 4, device=device)),
                       torch.zeros(2, 3, 4, device=device))


f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
CASES = {
    "oracle-f32-odd": _against_oracle(2, 5, 70, 33, f32, False),
    "oracle-bf16-strided": _against_oracle(3, 9, 64, 130, bf16, True),
    "oracle-f16-one-row": _against_oracle(1, 1, 40, 17, f16, False),
    "oracle-f32-multi-tile": _against_oracle(1, 40, 96, 70, f32, True),
    "shards-f32": _shard_invariance(7, 48, 96, f32),
    "shards-bf16": _shard_invariance(3, 64, 120, bf16),
    "out-bf16-from-bf16": _out_dtype(bf16, bf16),
    "out-bf16-from-f32": _out_dtype(f32, bf16),
    "out-f16-from-f16": _out_dtype(f16, f16),
    "errors": _errors,
}


def test_matmul_fixed_tiling_interpreted_on_cpu():
    check_in_child(__file__, list(CASES))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_matmul_fixed_tiling_cuda(name):
    CASES[name]("cuda")


if __name__ == "__main__":
    run_cases(CASES)
