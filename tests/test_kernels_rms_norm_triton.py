"""The Triton residual-add + RMS norm (the CUDA path) against the torch formulas of tpguide.model.norm, and row by row.

On CPU the kernel runs under ``TRITON_INTERPRET=1`` in a child process
(``tests/triton_interpreted.py``); with a GPU the cases also run compiled.
Checks: values against the torch norms (Llama's ``w * x̂.to(dtype)``,
Gemma's ``(1 + w)``), ``x + residual`` bit for bit, and a row's bits alone
equal to its bits among other rows.

Run directly with ``TRITON_INTERPRET=1 python tests/test_kernels_rms_norm_triton.py [NAME...]``.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreted import check_in_child, run_cases

pytest.importorskip("triton")

f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16


def _randn(*shape, dtype, device, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(device, dtype)


def _torch_norm(h, weight, eps, gemma):
    """The formulas of tpguide.model.norm (plain torch, on CPU)."""
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (normed * (1.0 + weight.float())).to(h.dtype)
    return weight * normed.to(h.dtype)


def _norm_case(dtype, d, gemma, residual):
    def case(device):
        from tpguide.kernels.rms_norm_triton import rms_norm_triton
        x = _randn(9, d, dtype=dtype, device=device, seed=1, scale=3.0)
        r = _randn(9, d, dtype=dtype, device=device, seed=2) if residual else None
        w = _randn(d, dtype=dtype, device=device, seed=3)
        out, h = rms_norm_triton(x, w, 1e-6, r, gemma=gemma)
        want_h = x.cpu() if r is None else x.cpu() + r.cpu()
        if residual:
            assert torch.equal(h.cpu(), want_h)
        else:
            assert h is None
        tol = {f32: 1e-5, bf16: 1.6e-2, f16: 2e-3}[dtype]
        torch.testing.assert_close(out.cpu().float(), _torch_norm(want_h, w.cpu(), 1e-6, gemma).float(),
                                   atol=tol, rtol=tol)
        for rows in ([4], [0, 8], [3, 5, 6]):  # a row alone or among others: the same bits
            sub_out, sub_h = rms_norm_triton(x[rows], w, 1e-6, None if r is None else r[rows], gemma=gemma)
            assert torch.equal(sub_out, out[rows])
        heads, _ = rms_norm_triton(x.view(3, 3, d), w, 1e-6, gemma=gemma)  # [T, H, D] per-head rows
        assert heads.shape == (3, 3, d)
        if not residual:
            assert torch.equal(heads.view(9, d), out)
    return case


def _errors(device):
    from tpguide.kernels.rms_norm_triton import rms_norm_triton
    x = torch.zeros(2, 8, device=device)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.zeros(7, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_triton(x, torch.zeros(8, device=device), 1e-6, torch.zeros(2, 8, device=device, dtype=bf16))
    out, _ = rms_norm_triton(torch.zeros(0, 8, device=device), torch.zeros(8, device=device), 1e-6)
    assert out.shape == (0, 8)


CASES = {
    "llama-bf16-residual": _norm_case(bf16, 96, False, True),
    "llama-f32-two-chunks": _norm_case(f32, 1500, False, False),
    "llama-f16": _norm_case(f16, 40, False, True),
    "gemma-bf16": _norm_case(bf16, 64, True, False),
    "gemma-f32-residual": _norm_case(f32, 33, True, True),
    "errors": _errors,
}


def test_rms_norm_interpreted_on_cpu():
    check_in_child(__file__, list(CASES))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_rms_norm_cuda(name):
    CASES[name]("cuda")


if __name__ == "__main__":
    run_cases(CASES)
