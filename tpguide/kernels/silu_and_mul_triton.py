"""SiLU-and-multiply of the merged gate/up projection in one Triton launch (vLLM's ``SiluAndMul``), the CUDA path's MLP.

``F.silu(gate) * up`` is two kernels and a ``[T, I]`` intermediate; here one
program handles :data:`BLOCK` columns of one row and writes
``rne(rne(silu(g)) * u)``: SiLU in fp32, rounded to the model dtype as
torch stores it, then the product in fp32, rounded again
(:func:`~tpguide.kernels.triton_cast.cast_rne`), compiled without
multiply-add fusion.  SiLU is ``g / (1 + exp(-g))`` with Triton's ``exp``,
so an element may differ from torch's by the last bit of the SiLU (the
model's CPU and CUDA paths agree within rounding, not bit for bit); every
element is computed alike wherever it sits, so a row's bits do not depend
on the batch, its place or the tp size (docs/gpu.md, "Kernels per decoder
layer").  Runs on CPU tensors under ``TRITON_INTERPRET=1`` (the tests).
SiLU: Elfwing et al., "Sigmoid-Weighted Linear Units" (2017).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpguide.kernels.triton_cast import cast_rne

#: Columns per program.
BLOCK = 1024

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width  # width = I: gate columns [0, I), up columns [I, 2 I)
    g = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + width + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty  # gate_up's
    act = cast_rne(g / (1.0 + tl.exp(-g)), dtype).to(tl.float32)  # torch stores silu(gate) in the model dtype
    tl.store(out_ptr + row * stride_out + cols, cast_rne(act * u, dtype), mask=ok)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]``: ``[T, 2 I] -> [T, I]`` in ``gate_up``'s dtype.

    Parameters
    ----------
    gate_up : torch.Tensor
        ``[T, 2 I]`` (tokens, gate then up columns) float32, bfloat16 or
        float16, unit last stride.

    Returns
    -------
    torch.Tensor
        ``[T, I]``, contiguous, a new tensor.

    Raises
    ------
    ValueError
        Not a 2-d tensor of an even width, another dtype, or a last stride
        that is not 1 (the message names them).
    """
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.dtype not in _DTYPES or gate_up.stride(-1) != 1:
        raise ValueError(f"gate_up must be [T, 2 I] of float32, bfloat16 or float16 with a unit last stride, got "
                         f"{gate_up.dtype} {list(gate_up.shape)} strides {gate_up.stride()}")
    tokens, width = gate_up.shape
    out = torch.empty((tokens, width // 2), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        _silu_and_mul_kernel[(tokens, triton.cdiv(width // 2, BLOCK))](
            gate_up, out, gate_up.stride(0), out.stride(0), width // 2, BLOCK=BLOCK,
            enable_fp_fusion=False,
        )
    return out
