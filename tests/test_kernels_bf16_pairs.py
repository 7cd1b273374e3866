"""The bf16 pair kernels (``VDPBF16PS``, ``TDPBF16PS``): the plain-C emulation of the manuals' pseudo-code
against a scalar numpy oracle on every machine, and the instruction against the emulation where the CPU has it.

The oracle computes each ``+=`` of the Intel SDM's pseudo-code in float64 (a
bf16 x bf16 product is exact there, and one float64 rounding then the fp32
cast rounds as one fp32 FMA: 53 >= 2 * 24 + 2), reads denormal bf16 inputs as
zeros and flushes denormal fp32 results to zeros of their sign.  The edge data
put denormal inputs, products below fp32's normal range and cancelling sums
into every chain (docs/exactness.md "CPU classes").
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from tpguide.kernels import fixed_order_cpu
from tpguide.kernels.c_library import load_library
from tpguide.kernels.fixed_order_cpu import (
    BASE_CFLAGS,
    ISA_CFLAGS,
    PAIR_INSTRUCTIONS,
    SOURCE,
    cpu_flags,
    kernel_isa,
    linear_fixed_order,
    linear_pairs_emulated,
    pack_weight,
)

#: (M, N, K, units): odd K_unit too.  9 .. 64 rows with units of 128 k pairs or more take the kernel's
#: few-row-blocks path (k in blocks of 128 pairs): 2, 3, 4 and 8 row blocks, a last block of fewer than 8
#: rows, one unit and two, pairs crossing a block and a multiple of it; 65 rows (9 row blocks, 150-pair units)
#: take the one-tile path.
SHAPES = [(1, 33, 16, 1), (9, 70, 37, 1), (13, 40, 90, 6), (20, 70, 600, 2), (10, 40, 256, 1), (32, 70, 514, 2),
          (27, 33, 300, 1), (64, 33, 520, 1), (65, 17, 600, 2),
          (20, 64, 130, 2)]


def bf16_bits(shape, seed, edge, huge=False):
    """bf16 ``shape``: N(0, 1) values, or (``edge``) a mix of those, bf16 denormals, tiny normals and zeros,
    row 0 all denormals and row 1 all tiny; ``huge`` puts values of 2^40 .. 2^60 in the even rows (the
    weights': a denormal times one is then far above fp32's normal range, so reading it as zero shows; a
    tiny value times an odd row's value is often below it, so flushing shows)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(torch.bfloat16)
    if not edge:
        return x
    bits = x.view(torch.int16).clone()
    kind = torch.randint(0, 8, shape, generator=g)
    sign = torch.randint(0, 2, shape, generator=g).to(torch.int16) << 15
    mantissa = torch.randint(0, 128, shape, generator=g).to(torch.int16)
    denormal = sign | torch.clamp(mantissa, min=1)  # exponent 0: read as zero by the instructions
    tiny = sign | (torch.randint(1, 6, shape, generator=g).to(torch.int16) << 7) | mantissa  # 2^-126 .. 2^-120
    big = sign | (torch.randint(167, 188, shape, generator=g).to(torch.int16) << 7) | mantissa  # 2^40 .. 2^60
    bits = torch.where(kind == 0, denormal, torch.where(kind == 1, tiny, torch.where(kind == 2, sign, bits)))
    if huge:
        bits = torch.where((kind == 3) & (torch.arange(shape[0])[:, None] % 2 == 0), big, bits)
    elif shape[0] > 2:
        bits[0], bits[1] = denormal[0], tiny[1]
    return bits.view(torch.bfloat16)


def pair_chain_oracle(x, w, instruction="VDPBF16PS", daz=True, ftz=True, order=None):
    """fp32 ``[M, N]``: the SDM pseudo-code of ``instruction`` from 0, each element in numpy.

    ``x [M, K]``, ``w [N, K]`` bf16, K zero-padded to a pair (a 32-wide tile for TDPBF16PS).
    ``daz`` / ``ftz`` off and ``order`` (``"even-first"``: one chain, each pair's even element first,
    the intrinsics guide's simpler text) give the variants the edge data must tell apart.
    """
    def widen(t):
        b = t.contiguous().view(torch.int16).numpy().astype(np.uint16)
        if daz:
            b = np.where(b & 0x7F80, b, b & 0x8000).astype(np.uint16)
        return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    def add(a, b):  # one fp32 rounding of an exact float64 sum (53 >= 2 * 24 + 2: no double-rounding error)
        s = (a.astype(np.float64) + b).astype(np.float32)
        return np.where(np.abs(s) < np.float32(2.0 ** -126), np.copysign(np.float32(0), s), s) if ftz else s

    xd, wd = widen(x), widen(w)
    width = 32 if instruction == "TDPBF16PS" else 2
    pad = -xd.shape[1] % width
    xd, wd = np.pad(xd, ((0, 0), (0, pad))), np.pad(wd, ((0, 0), (0, pad)))
    zeros = np.zeros((xd.shape[0], wd.shape[0]), dtype=np.float32)
    acc = zeros
    if instruction == "VDPBF16PS" or order == "even-first":
        for p in range(xd.shape[1] // 2):
            for e in ((2 * p, 2 * p + 1) if order == "even-first" else (2 * p + 1, 2 * p)):
                acc = add(acc, np.outer(xd[:, e], wd[:, e]))  # a bf16 x bf16 product is exact in float64
        return torch.from_numpy(acc)
    for k0 in range(0, xd.shape[1], 32):  # TDPBF16PS: per tile an even and an odd chain, then their sum
        even, odd = zeros, zeros
        for p in range(k0 // 2, k0 // 2 + 16):
            even = add(even, np.outer(xd[:, 2 * p], wd[:, 2 * p]))
            odd = add(odd, np.outer(xd[:, 2 * p + 1], wd[:, 2 * p + 1]))
        acc = add(acc, add(even, odd.astype(np.float64)).astype(np.float64))
    return torch.from_numpy(acc)


def oracle_by_units(x, w, units, **variant):
    """The units' chains added in unit order (``linear_fixed_order``'s ``sum_units``)."""
    k = x.shape[1] // units
    parts = [pair_chain_oracle(x[:, u * k:(u + 1) * k], w[:, u * k:(u + 1) * k], **variant) for u in range(units)]
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def bits_equal(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32))  # -0.0 and +0.0 told apart


@pytest.mark.parametrize("instruction,isa", [("VDPBF16PS", "avx512_bf16"), ("TDPBF16PS", "amx")],
                         ids=["VDPBF16PS", "TDPBF16PS"])
@pytest.mark.parametrize("edge", [False, True], ids=["normal", "edge"])
@pytest.mark.parametrize(("m", "n", "k", "units"), SHAPES)
def test_emulation_equals_the_scalar_oracle(m, n, k, units, edge, instruction, isa):
    x, w = bf16_bits((m, k), 1 + m, edge), bf16_bits((n, k), 2 + n, edge, huge=True)
    packed = pack_weight(w, units, isa=isa)
    got = linear_pairs_emulated(x, packed, instruction)
    assert bits_equal(got, oracle_by_units(x, w, units, instruction=instruction))
    partials = linear_pairs_emulated(x, packed, instruction, sum_units=False)
    kk = k // units
    for u in range(units):
        assert bits_equal(partials[u], pair_chain_oracle(x[:, u * kk:(u + 1) * kk], w[:, u * kk:(u + 1) * kk],
                                                         instruction=instruction))


@pytest.mark.parametrize("instruction", ["VDPBF16PS", "TDPBF16PS"])
def test_the_edge_data_tell_the_order_and_the_flushes_apart(instruction):
    """Each variant of the pseudo-code (another order, no DAZ, no FTZ) differs somewhere on the edge data."""
    m, n, k, units = SHAPES[-1]
    x, w = bf16_bits((m, k), 1 + m, True), bf16_bits((n, k), 2 + n, True, huge=True)
    want = oracle_by_units(x, w, units, instruction=instruction)
    others = [{"instruction": "TDPBF16PS" if instruction == "VDPBF16PS" else "VDPBF16PS"},
              {"order": "even-first"}, {"daz": False}, {"ftz": False}]
    for variant in others:
        got = oracle_by_units(x, w, units, **{"instruction": instruction, **variant})
        assert not bits_equal(got, want), variant


def dpbf16_library():
    """The kernels built for ``avx512_bf16`` (on an AMX CPU too: its own build has no VDPBF16PS tile)."""
    if "avx512_bf16" not in cpu_flags() or not {"avx512f", "avx512bw", "avx512vl", "fma"} <= cpu_flags():
        pytest.skip("this CPU lacks VDPBF16PS (AVX512_BF16 with AVX-512 F/BW/VL): the emulation alone is checked")
    lib = load_library(SOURCE, BASE_CFLAGS + ISA_CFLAGS["avx512_bf16"])
    assert lib.tpguide_has_dpbf16() == 1
    lib.tpguide_linear_units_pairs.argtypes = (ctypes.c_void_p, *[ctypes.c_int64] * 2, ctypes.c_void_p,
                                               *[ctypes.c_int64] * 3, ctypes.c_void_p, *[ctypes.c_int64] * 5)
    return lib


@pytest.mark.parametrize("edge", [False, True], ids=["normal", "edge"])
@pytest.mark.parametrize(("m", "n", "k", "units"), SHAPES)
def test_vdpbf16ps_kernel_equals_the_emulation(m, n, k, units, edge):
    lib = dpbf16_library()
    x, w = bf16_bits((m, k), 3 + m, edge), bf16_bits((n, k), 4 + n, edge, huge=True)
    packed = pack_weight(w, units, isa="avx512_bf16")
    xb = fixed_order_cpu._pair_rows(x, packed)
    kp = packed.padded_unit_size
    for sum_units, out_dtype in ((1, torch.float32), (1, torch.bfloat16), (0, torch.float32)):
        for threads in (1, 2):
            outs = []
            for emulate in (0, 1):
                out = torch.empty((m, n) if sum_units else (units, m, n), dtype=out_dtype)
                assert lib.tpguide_linear_units_pairs(xb.data_ptr(), m, units * kp, packed.panels.data_ptr(), kp,
                                                      units, n, out.data_ptr(), fixed_order_cpu.DTYPE_CODES[out_dtype],
                                                      sum_units, PAIR_INSTRUCTIONS["VDPBF16PS"], emulate, threads) == 0
                outs.append(out.float())
            assert bits_equal(*outs), (sum_units, out_dtype, threads)


def test_tdpbf16ps_kernel_equals_the_emulation():
    if kernel_isa() != "amx":
        pytest.skip(f"this CPU runs the {kernel_isa()} kernels, not TDPBF16PS (AMX-BF16 with the OS's tile state)")
    for m, n, k, units in SHAPES:
        for edge in (False, True):
            x, w = bf16_bits((m, k), 5 + m, edge), bf16_bits((n, k), 6 + n, edge, huge=True)
            packed = pack_weight(w, units)
            assert packed.amx
            assert bits_equal(linear_fixed_order(x, packed), linear_pairs_emulated(x, packed, "TDPBF16PS")), \
                (m, n, k, units, edge)


def test_a_layout_this_process_cannot_run_is_refused():
    x, w = bf16_bits((2, 8), 1, False), bf16_bits((3, 8), 2, False)
    if kernel_isa() != "amx":
        with pytest.raises(ValueError, match="packed for AMX tiles"):
            linear_fixed_order(x, pack_weight(w, isa="amx"))
    if not fixed_order_cpu.library().tpguide_has_dpbf16():
        with pytest.raises(ValueError, match="packed for VDPBF16PS"):
            linear_fixed_order(x, pack_weight(w, isa="avx512_bf16"))
    with pytest.raises(ValueError, match="not in k pairs"):
        linear_pairs_emulated(x, pack_weight(w, isa="avx2"))
    with pytest.raises(ValueError, match="32-wide k tiles"):
        linear_pairs_emulated(x, pack_weight(w, isa="avx512_bf16"), "TDPBF16PS")
    with pytest.raises(ValueError, match="instruction must be one of"):
        linear_pairs_emulated(x, pack_weight(w, isa="amx"), "VFMADD231PS")
    with pytest.raises(ValueError, match="isa='zen4'"):
        pack_weight(w, isa="zen4")
