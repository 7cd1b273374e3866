"""The kernels' intrinsics (AVX2 or AVX-512) give the plain C's bits, element for element.

Both builds of ``csrc/fixed_order_cpu.c`` come from the same flags for this
CPU's instruction set; one adds ``-DTPGUIDE_NO_INTRINSICS``, which compiles
the plain C (the linear's fma chain, attention's score and P V blocks, the
exp of SiLU and softmax) instead of the intrinsics (docs/architecture.md §6).
The shapes are awkward on purpose: rows not a multiple of the tile's rows,
columns not a multiple of the panel, unit widths across the k block, several
units, fp32 and bf16 weights, fp32, bf16 and per-unit outputs.
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch
from test_kernels_fixed_order import _cache_and_queries, _dense

import tpguide.kernels.fixed_order_cpu as fixed_order
from tpguide.kernels.c_library import load_library
from tpguide.kernels.fixed_order_cpu import BASE_CFLAGS, ISA_CFLAGS, PANEL, SOURCE, choose_isa, cpu_flags

ISA = choose_isa(cpu_flags(), os.environ.get("ATEN_CPU_CAPABILITY"))
pytestmark = pytest.mark.skipif(ISA == "default", reason="no SIMD tile on this CPU: both builds are the portable one")

def _library(portable: bool) -> ctypes.CDLL:
    flags = BASE_CFLAGS + ISA_CFLAGS[ISA] + (("-DTPGUIDE_NO_INTRINSICS",) if portable else ())
    lib, loaded = load_library(SOURCE, flags), fixed_order.library()
    for name in ("tpguide_linear_units", "tpguide_unary", "tpguide_attention", "tpguide_attention_scratch_floats"):
        getattr(lib, name).argtypes = getattr(loaded, name).argtypes
        getattr(lib, name).restype = getattr(loaded, name).restype
    return lib


def _panels(w: torch.Tensor, units: int) -> torch.Tensor:
    """``w [N, U * K_unit]`` -> ``[U, P, K_unit, PANEL]``, zero past N (the non-AMX packing)."""
    n, k = w.shape
    p = -(-n // PANEL)
    padded = w.new_zeros(p * PANEL, k)
    padded[:n] = w
    return padded.view(p, PANEL, units, k // units).permute(2, 0, 3, 1).contiguous()


def _run(lib, x, panels, units, n, out_dtype, sum_units, threads):
    m, k = x.shape
    shape = (m, n) if sum_units else (units, m, n)
    out = torch.full(shape, float("nan"), dtype=out_dtype)
    status = lib.tpguide_linear_units(x.data_ptr(), m, k, panels.data_ptr(), 0 if panels.dtype == torch.float32 else 2,
                                      k // units, units, n, out.data_ptr(), 0 if out_dtype == torch.float32 else 2,
                                      int(sum_units), threads)
    assert status == 0
    return out


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k_unit", "units"), [(1, 1, 1, 1), (3, 33, 7, 1), (5, 70, 300, 1),
                                                         (13, 31, 64, 3), (8, 96, 520, 2), (37, 65, 129, 4)])
def test_simd_tile_equals_portable_tile_bit_for_bit(w_dtype, m, n, k_unit, units):
    simd, portable = _library(False), _library(True)
    gen = torch.Generator().manual_seed(m * 1000 + n + k_unit)
    k = k_unit * units
    # magnitudes over several binades, so that a different order or a lost fma would show in the last bits
    x = (torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-6, 7, (m, k), generator=gen).float()))
    w = (torch.randn(n, k, generator=gen) * 0.05).to(w_dtype)
    panels = _panels(w, units)
    for out_dtype, sum_units in ((torch.float32, True), (torch.bfloat16, True), (torch.float32, False)):
        for threads in (1, 2):
            want = _run(portable, x, panels, units, n, out_dtype, sum_units, 1)
            got = _run(simd, x, panels, units, n, out_dtype, sum_units, threads)
            assert torch.equal(got.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32),
                               want.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32)), \
                f"ISA {ISA}: {(m, n, k_unit, units)} {w_dtype} -> {out_dtype} sum_units={sum_units} threads={threads}"
    # and the values are the product: the fp64 oracle within fp32 rounding
    want64 = sum((x[:, u * k_unit:(u + 1) * k_unit].double() @ w[:, u * k_unit:(u + 1) * k_unit].double().T)
                 for u in range(units))
    torch.testing.assert_close(_run(simd, x, panels, units, n, torch.float32, True, 2).double(), want64,
                               rtol=1e-4, atol=1e-3)


def test_vector_silu_equals_scalar_silu_bit_for_bit():
    gen = torch.Generator().manual_seed(11)
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 87.0, -87.0, -87.3, -87.4, -100.0, 100.0, 1e30, -1e30,
                            float("inf"), float("-inf"), 88.7, -88.7, 0.5, -0.5])
    x = torch.cat([special, torch.randn(4001, generator=gen) * 20, torch.randn(999, generator=gen) * 0.01])
    outs = []
    for lib in (_library(False), _library(True)):
        out = torch.full_like(x, float("nan"))
        lib.tpguide_unary(x.data_ptr(), x.numel(), 0, 0.0, out.data_ptr(), 2)
        outs.append(out)
    assert torch.equal(outs[0].view(torch.int32), outs[1].view(torch.int32)), \
        x[outs[0].view(torch.int32) != outs[1].view(torch.int32)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "d", "window", "softcap"),
                         [(9, 3, 64, None, None), (6, 2, 40, 37, None), (4, 4, 130, None, 2.0), (3, 1, 7, None, None)])
def test_vector_attention_equals_plain_c_bit_for_bit(monkeypatch, dtype, heads, kv_heads, d, window, softcap):
    """Score blocks of 64 keys and P V blocks of 16 dims, with key and head-dim remainders."""
    q, kc, vc, slots, pos = _cache_and_queries(dtype, [150, 1, 70, 9], heads, kv_heads, d, length=160)
    outs = []
    for portable in (False, True):
        monkeypatch.setattr(fixed_order, "_LIB", _library(portable))
        for out_dtype in (torch.float32, torch.bfloat16):
            outs.append(_dense(q, kc, vc, slots, pos, 0.1, window, softcap, out_dtype))
    assert all(torch.equal(a, b) for a, b in zip(outs[:2], outs[2:])), (heads, kv_heads, d, window, softcap)
