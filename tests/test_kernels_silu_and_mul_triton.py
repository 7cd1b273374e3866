"""The one-launch SiLU-and-multiply against torch's ``F.silu(gate) * up``, and the same bits for a row wherever it sits.

On CPU the kernel runs under ``TRITON_INTERPRET=1`` in a child process
(``tests/triton_interpreted.py``); with a GPU the cases also run compiled.
Checks: at most 1 ulp from torch in bf16, 2 in fp16, 8 in fp32 (a SiLU one
ulp off, rounded twice), at widths below, at and above a block; bit for
bit, a row alone equals the row among others and in a strided view; the
errors it raises.

Run directly with ``TRITON_INTERPRET=1 python tests/test_kernels_silu_and_mul_triton.py [NAME...]``.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreted import check_in_child, run_cases

pytest.importorskip("triton")


def _against_torch(dtype, width):
    def case(device):
        import torch.nn.functional as F

        from tpguide.kernels.silu_and_mul_triton import silu_and_mul_triton
        g = torch.Generator().manual_seed(width)
        gate_up = (torch.randn(6, 2 * width, generator=g) * 4).to(dtype).to(device)
        got = silu_and_mul_triton(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        want = F.silu(gate) * up  # torch's two kernels
        view = torch.int32 if dtype == torch.float32 else torch.int16
        ulps = (got.view(view).long() - want.view(view).long()).abs()  # same signs: the distance in ulps
        assert torch.equal(got.sign(), want.sign()) and int(ulps.max()) <= {torch.float32: 8, torch.float16: 2}.get(dtype, 1), \
            int(ulps.max())
        for rows in ([5], [0, 3]):  # alone or beside another row: the same bits
            assert torch.equal(silu_and_mul_triton(gate_up[rows]).view(view), got[rows].view(view))
        wide = torch.cat([gate_up, gate_up], dim=1)[:, :2 * width]  # the same rows, 4 I apart
        assert wide.stride(0) == 4 * width and torch.equal(silu_and_mul_triton(wide).view(view), got.view(view))
    return case


def _errors(device):
    from tpguide.kernels.silu_and_mul_triton import silu_and_mul_triton
    for bad in (torch.zeros(3, 5, device=device), torch.zeros(4, device=device),
                torch.zeros(3, 4, dtype=torch.float64, device=device), torch.zeros(4, 3, device=device).t()):
        with pytest.raises(ValueError, match="gate_up must be"):
            silu_and_mul_triton(bad)
    assert silu_and_mul_triton(torch.zeros(0, 8, device=device)).shape == (0, 4)


CASES = {
    **{f"torch_{dt}_{w}": _against_torch(getattr(torch, dt), w)
       for dt, w in (("float32", 96), ("bfloat16", 96), ("bfloat16", 1536), ("float16", 1024), ("float32", 1030))},
    "errors": _errors,
}


def test_silu_and_mul_interpreted_on_cpu():
    check_in_child(__file__, list(CASES))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_silu_and_mul_cuda(name):
    CASES[name]("cuda")


if __name__ == "__main__":
    run_cases(CASES)
