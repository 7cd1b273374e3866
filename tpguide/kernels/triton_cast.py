"""fp32 -> model dtype rounded to nearest-even in a Triton kernel, the same bits compiled and interpreted.

Compiled on CUDA, ``x.to(tl.bfloat16)`` rounds to nearest-even (``cvt.rn``),
as torch's ``.to(torch.bfloat16)`` does; the Triton interpreter (the CPU
tests) truncates instead.  :func:`cast_rne` rounds bf16 by integer
arithmetic on the fp32 bits, so a kernel's stores are torch's rounding
on both.  float16 (numpy's cast in the interpreter, ``cvt.rn`` on CUDA) and
float32 use the plain cast.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cast_rne(x, dtype: tl.constexpr):
    """fp32 ``x`` as ``dtype`` (float32, float16 or bfloat16), rounded to nearest, ties to even."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # round the low 16 bits away
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)  # exact: nothing left to round
    else:
        return x.to(dtype)
