"""Fixed-order CPU kernels: matmuls, attention and RMS statistics whose every output element is one
fixed sequence of fused multiply-adds (docs/architecture.md §6, "Fixed-order reductions").

Library GEMMs (MKL, oneDNN) choose their blocking, and with it each element's
order of additions, from the problem shape and the thread count, so a row's
logits change with the rows beside it, with the columns per rank and with the
threads.  The kernels of ``csrc/fixed_order_cpu.c`` fix the order in the code:

* **linear**: ``out[m, n] = fma chain over k`` (from 0, k ascending) of
  ``x[m, k] * w[n, k]``; with reduction units (row-parallel layers) each unit
  is such a chain and the units are added in unit order.  Weights are packed
  once into panels of :data:`PANEL` columns (:func:`pack_weight`).  bf16 on a
  CPU with AMX: one ``TDPBF16PS`` per 32-wide k tile, k tiles ascending, the
  hardware's fixed order inside a tile (a tile's rows are independent), on
  weights packed in pairs (VNNI).  bf16 on a CPU with AVX512_BF16 (no AMX):
  one ``VDPBF16PS`` per k pair, pairs ascending, on the same pair layout
  (:func:`linear_pairs_emulated` is the plain-C emulation of its documented
  semantics, docs/exactness.md "CPU classes").
* **attention** (over a paged or dense KV cache): per query token and head,
  each score an fma chain over the head dim (one key per vector lane),
  softmax with a pure-arithmetic ``exp`` (the same bits vectorised or not)
  summed in 16 lanes by key index then a fixed tree, ``P V`` as an fma chain
  in key order; register blocks of 4 query rows share the key loads.
* **RMS statistics**: the same fixed dot product of a row with itself, over ``D``.
* **element-wise functions**: SiLU from the pure-arithmetic ``exp``
  (vectorised, the scalar bits), tanh-GELU, soft-capping, cos and sin by
  scalar libm calls for every element.  torch evaluates them with vector
  approximations in the body of a loop and scalar ones in its tail, and the
  tail moves with the tensor's size and the thread split.

Each element is computed by one thread, so the thread count does not matter;
``fmaf`` is exactly rounded, so the vector code (AVX-512 or AVX2 + FMA
intrinsics, which repeat the plain C's IEEE operations, or the compiler's
vectorisation of the portable loops) gives the bits of the scalar code: the same results on every x86-64 CPU class, except bf16 matmuls
on AMX and AVX512_BF16, whose pair order is the instruction's (fixed, but not
the fmaf chain): :data:`OWN_BF16_ORDER_ISAS`.

Instruction set (the CPU class): AMX (with AVX-512) where the CPU has AMX-BF16
and the kernel grants the tile state, else AVX-512 with AVX512_BF16
(``avx512_bf16``), else AVX-512 (F, BW), else AVX2 + FMA, else portable C;
``ATEN_CPU_CAPABILITY=avx512``, ``avx2`` or ``default`` forces a narrower one
(the same variable torch reads; ``avx512`` gives the fmaf-chain bf16 tile on
an AVX512_BF16 CPU), :func:`kernel_isa` names the one in use and
:func:`matmul_instruction` the instruction a matmul of a dtype runs on.  The
library is compiled on first use (:mod:`tpguide.kernels.c_library`) with
OpenMP; the ``libgomp`` torch has loaded serves both, so no second thread pool
spins beside torch's.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from tpguide.kernels.c_library import CSRC, load_library

SOURCE = CSRC / "fixed_order_cpu.c"
#: Columns per packed weight panel (``NB`` in the C source).
PANEL = 32
#: Weight rows zero-padded per pass when packing a pair layout (bounds the packing's transient memory).
PACK_CHUNK_ROWS = 2048
#: Largest head dimension the attention kernel takes (``MAX_HEAD_DIM``).
MAX_HEAD_DIM = 512
#: Query rows (tokens x query heads of one KV head) per attention work item (``MAX_ROWS``).
MAX_ROWS = 64
BASE_CFLAGS = ("-O3", "-std=gnu99", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-strict-aliasing")
ISA_CFLAGS = {
    "amx": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mamx-tile", "-mamx-bf16", "-mprefer-vector-width=512"),
    "avx512_bf16": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mavx512bf16", "-mprefer-vector-width=512"),
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mprefer-vector-width=512"),
    "avx2": ("-mavx2", "-mfma"),
    "default": (),
}
#: The classes, narrowest first (``choose_isa``'s order).
ISA_ORDER = ("default", "avx2", "avx512", "avx512_bf16", "amx")
#: Classes whose bf16 matmuls run the instruction's own pair order, not the fmaf chain: their bf16
#: bits differ from the other classes' (docs/exactness.md "CPU classes").
OWN_BF16_ORDER_ISAS = ("avx512_bf16", "amx")
#: Weight / activation dtype codes of the C kernels.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 2}

_LOCK = threading.Lock()
_LIB: Optional[ctypes.CDLL] = None
_ISA: Optional[str] = None
_HAS_DPBF16 = False  # the loaded library has the VDPBF16PS tile (asked once, not per matmul)
_SCRATCH = threading.local()  # per-thread kept scratch buffers (kept_scratch), reused across calls and layers
_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


def cpu_flags() -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def choose_isa(flags: set[str], forced: Optional[str]) -> str:
    """A name of :data:`ISA_ORDER`: the widest class the CPU has, capped by ``forced``.

    ``flags`` are ``/proc/cpuinfo``'s (:func:`cpu_flags`); ``forced`` is
    ``ATEN_CPU_CAPABILITY``'s value (one of those names; None or empty =
    unset); an unknown value raises ``ValueError`` naming it.
    """
    order = list(ISA_ORDER)
    have = "default"
    if {"avx2", "fma"} <= flags:
        have = "avx2"
    if {"avx512f", "avx512bw", "avx512vl", "fma"} <= flags:
        have = "avx512"
        if "avx512_bf16" in flags:
            have = "avx512_bf16"
        if {"amx_tile", "amx_bf16"} <= flags:
            have = "amx"
    if forced is None or not forced.strip():  # unset or empty: torch ignores it too
        return have
    forced = forced.lower()
    if forced not in order:
        raise ValueError(f"ATEN_CPU_CAPABILITY={forced!r} is not one of {order}")
    return order[min(order.index(have), order.index(forced))]


def _load() -> ctypes.CDLL:
    global _LIB, _ISA, _HAS_DPBF16
    if _LIB is None:
        with _LOCK:
            if _LIB is None:
                flags = cpu_flags()
                isa = choose_isa(flags, os.environ.get("ATEN_CPU_CAPABILITY"))
                lib = load_library(SOURCE, BASE_CFLAGS + ISA_CFLAGS[isa])
                if isa == "amx" and lib.tpguide_amx_init() != 0:  # the OS refused the tile state
                    isa = "avx512_bf16" if "avx512_bf16" in flags else "avx512"
                    lib = load_library(SOURCE, BASE_CFLAGS + ISA_CFLAGS[isa])
                if isa == "amx":
                    lib.tpguide_linear_units_amx.argtypes = (_ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64,
                                                             _i64, _i64)
                    lib.tpguide_linear_units_amx.restype = ctypes.c_int
                lib.tpguide_linear_units.argtypes = (_ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _i64,
                                                     _i64)
                lib.tpguide_linear_units.restype = ctypes.c_int
                lib.tpguide_linear_units_pairs.argtypes = (_ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64,
                                                           _i64, _i64, _i64)
                lib.tpguide_linear_units_pairs.restype = ctypes.c_int
                lib.tpguide_has_dpbf16.restype = ctypes.c_int
                lib.tpguide_sum_units.argtypes = (_ptr, _i64, _i64, _ptr, _i64, _ptr)
                lib.tpguide_sum_units.restype = None
                lib.tpguide_attention.argtypes = (_ptr, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr,
                                                  _i64, _i64, _i64, _i64, _i64, _f32, _i64, _f32, _ptr, _ptr, _i64, _i64)
                lib.tpguide_attention.restype = ctypes.c_int
                lib.tpguide_attention_scratch_floats.argtypes = (_i64, _i64)
                lib.tpguide_attention_scratch_floats.restype = _i64
                lib.tpguide_mean_square.argtypes = (_ptr, _i64, _i64, _ptr, _i64)
                lib.tpguide_mean_square.restype = None
                lib.tpguide_unary.argtypes = (_ptr, _i64, _i64, _f32, _ptr, _i64)
                lib.tpguide_unary.restype = None
                lib.tpguide_add_rms_norm.argtypes = (_ptr, _ptr, _ptr, _i64, _i64, _i64, _f32, _ptr, _ptr, _i64)
                lib.tpguide_add_rms_norm.restype = ctypes.c_int
                lib.tpguide_act_and_mul.argtypes = (_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _i64)
                lib.tpguide_act_and_mul.restype = ctypes.c_int
                lib.tpguide_rotary.argtypes = (_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _i64, _i64,
                                               _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64)
                lib.tpguide_rotary.restype = ctypes.c_int
                lib.tpguide_decoder_layers.argtypes = (_ptr, _i64, _ptr, _ptr, _ptr, _i64)
                lib.tpguide_decoder_layers.restype = ctypes.c_int
                lib.tpguide_decoder_half.argtypes = (_ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr)
                lib.tpguide_decoder_half.restype = ctypes.c_int
                lib.tpguide_stack_work_bytes.argtypes = (_i64,) * 8
                lib.tpguide_stack_work_bytes.restype = _i64
                _HAS_DPBF16 = bool(lib.tpguide_has_dpbf16())
                _ISA, _LIB = isa, lib
    return _LIB


def library() -> ctypes.CDLL:
    """The compiled kernel library, every function's ``argtypes`` set (compiles it on first call)."""
    return _LIB or _load()


def kernel_isa() -> str:
    """The instruction set the kernels were compiled for (compiles them on first call)."""
    _load()
    return _ISA


def matmul_instruction(dtype: torch.dtype) -> str:
    """The instruction a fixed-order matmul of ``dtype`` weights runs on in this process, with its class.

    E.g. ``"VDPBF16PS (avx512_bf16)"`` for bf16 on an AVX512_BF16 CPU, ``"VFMADD231PS zmm (avx512_bf16)"``
    for fp32 there, ``"fmaf (default)"`` for the portable build (compiles the kernels on first call).
    """
    isa = kernel_isa()
    if dtype == torch.bfloat16 and isa in OWN_BF16_ORDER_ISAS:
        return f"{'TDPBF16PS' if isa == 'amx' else 'VDPBF16PS'} ({isa})"
    return f"{'fmaf' if isa == 'default' else 'VFMADD231PS ' + ('ymm' if isa == 'avx2' else 'zmm')} ({isa})"


def _threads() -> int:
    return torch.get_num_threads()


#: Elements an element-wise kernel gives each thread at least: below it a parallel region costs
#: more than it saves (waking a sleeping thread on a shared machine takes tens of microseconds).
ELEMENTS_PER_THREAD = 16384


def threads_for(elements: int) -> int:
    """Threads for an element-wise kernel over ``elements`` values: ``torch.get_num_threads()``, capped so
    that each thread gets at least :data:`ELEMENTS_PER_THREAD` (1 for a decode step's norms and rotary).

    Every row (or element) is computed by one thread in the same order whatever the count, so the
    count changes no bit (docs/exactness.md).
    """
    return max(1, min(torch.get_num_threads(), elements // ELEMENTS_PER_THREAD))


def _dtype_code(t: torch.Tensor, what: str) -> int:
    code = DTYPE_CODES.get(t.dtype)
    if code is None:
        raise ValueError(f"{what} must be float32 or bfloat16 for the fixed-order CPU kernels, got {t.dtype}")
    return code


@dataclass(frozen=True)
class PackedWeight:
    """A weight ``[N, U * K_unit]`` packed for :func:`linear_fixed_order`.

    Attributes
    ----------
    panels : torch.Tensor
        ``[U, ceil(N / PANEL), K_unit, PANEL]`` in the weight's dtype (fp32 or
        bf16), zero past column ``N``: ``panels[u, p, k, j] = w[p*PANEL + j, u*K_unit + k]``;
        bf16 on AMX and AVX512_BF16 ``[U, ceil(N / PANEL), K_pad / 2, PANEL, 2]`` (k pairs
        adjacent, ``K_pad`` = ``K_unit`` rounded up to 32 on AMX, to 2 on AVX512_BF16,
        zero past ``K_unit``).
    out_features, unit_size, num_units : int
        ``N``, ``K_unit``, ``U``.
    padded_unit_size : int
        ``K_pad`` in the pair layouts, else ``K_unit``.
    source_version : tuple
        ``(data_ptr, _version)`` of the weight it was packed from (to notice an in-place update).
    isa : str
        The class it was packed for (:func:`kernel_isa`; only ``"amx"`` and
        ``"avx512_bf16"`` change the layout, and only for bf16).
    """

    panels: torch.Tensor
    out_features: int
    unit_size: int
    num_units: int
    source_version: tuple
    padded_unit_size: int
    isa: str = "default"

    @property
    def amx(self) -> bool:
        """Packed for the AMX tile kernel (bf16 on an AMX CPU)."""
        return self.panels.dim() == 5 and self.isa == "amx"

    @property
    def pairs(self) -> bool:
        """Packed for the ``VDPBF16PS`` pair kernel (bf16 on an AVX512_BF16 CPU without AMX)."""
        return self.panels.dim() == 5 and self.isa == "avx512_bf16"


def pack_weight(weight: torch.Tensor, num_units: int = 1, isa: Optional[str] = None) -> PackedWeight:
    """Pack ``weight [N, K]`` (any strides, CPU, fp32 or bf16) into panels; ``K % num_units == 0``.

    ``isa``: the class to pack for, a name of :data:`ISA_ORDER` (default
    :func:`kernel_isa`); ``"avx512"`` on an AVX512_BF16 or AMX CPU gives the
    fmaf-chain layout (benchmarks compare the two), and any pair layout can be
    packed anywhere for :func:`linear_pairs_emulated`.

    Raises
    ------
    ValueError
        Another dtype or device, ``K`` not divisible by ``num_units``, or an unknown ``isa``.
    """
    if isa is not None and isa not in ISA_ORDER:
        raise ValueError(f"isa={isa!r} is not one of {ISA_ORDER}")
    _dtype_code(weight, "weight")
    if weight.device.type != "cpu":
        raise ValueError(f"fixed-order CPU kernels need CPU tensors, got weight on {weight.device}")
    n, k = weight.shape
    if num_units < 1 or k % num_units:
        raise ValueError(f"in_features={k} is not divisible by num_units={num_units}")
    unit = k // num_units
    isa = isa or kernel_isa()
    pairs = weight.dtype == torch.bfloat16 and isa in OWN_BF16_ORDER_ISAS
    padded_unit = -(-unit // (32 if isa == "amx" else 2)) * (32 if isa == "amx" else 2) if pairs else unit
    num_panels = -(-n // PANEL)
    rows = weight.reshape(n, num_units, unit)  # [N, U, K_unit]
    if pairs:  # [U, P, K_pad / 2, PANEL, 2]: 16 columns' k pairs per AMX B tile row or per zmm
        panels = weight.new_empty((num_units, num_panels, padded_unit // 2, PANEL, 2))
        step = max(1, PACK_CHUNK_ROWS // PANEL)  # panels per pass: the zero-padded transient stays small
        for p0 in range(0, num_panels, step):
            p1 = min(num_panels, p0 + step)
            padded = weight.new_empty((p1 - p0, PANEL, num_units, padded_unit))
            _copy_zero_padded(padded, rows[p0 * PANEL:p1 * PANEL])
            panels[:, p0:p1].copy_(padded.view(p1 - p0, PANEL, num_units, padded_unit // 2, 2).permute(2, 0, 3, 1, 4))
    else:  # written in place through a [P, PANEL, U, K_unit] view: one pass over the weight, no zeroing pass
        panels = weight.new_empty((num_units, num_panels, unit, PANEL))
        _copy_zero_padded(panels.permute(1, 3, 0, 2), rows)
    return PackedWeight(panels, n, unit, num_units, (weight.data_ptr(), weight._version), padded_unit, isa)


def _copy_zero_padded(dst: torch.Tensor, rows: torch.Tensor) -> None:
    """``dst [P, PANEL, U, K_dst]`` (any strides) = ``rows [N, U, K]``, zero past row ``N`` and column ``K``.

    Every element of ``dst`` is written exactly once (``dst`` may be uninitialised).
    """
    n, _, unit = rows.shape
    full = n // PANEL
    dst[:full, :, :, :unit].copy_(rows[:full * PANEL].unflatten(0, (full, PANEL)))
    if full < dst.shape[0]:  # the last panel: its real columns, then zeros
        tail = n - full * PANEL
        dst[full, :tail, :, :unit].copy_(rows[full * PANEL:])
        dst[full, tail:, :, :unit].zero_()
    if unit < dst.shape[3]:
        dst[..., unit:].zero_()


def check_out(out: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """Raise ``ValueError`` naming the values unless ``out`` is a contiguous ``shape`` tensor of ``dtype`` on ``device``."""
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape {shape} on {device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device} (contiguous: {out.is_contiguous()})")


def linear_fixed_order(x: torch.Tensor, packed: PackedWeight, sum_units: bool = True,
                       out_dtype: torch.dtype = torch.float32, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ w.T`` in the fixed order (module docstring); rows of ``x`` never influence each other.

    Parameters
    ----------
    x : torch.Tensor
        ``[M, U * K_unit]`` fp32 or bf16 on CPU (tokens, input features); bf16 is widened exactly
        (cast to bf16 for weights packed in pairs: AMX, AVX512_BF16).
    packed : PackedWeight
    sum_units : bool
        True: fp32 ``[M, N]``, the units added in unit order.  False: fp32
        ``[U, M, N]``, one partial per unit (the row-parallel all-gather input).
    out_dtype : torch.dtype
        ``torch.bfloat16`` (with ``sum_units`` only): each fp32 sum rounded at the
        store exactly as ``.to(torch.bfloat16)`` (nearest even; NaN stays NaN), the
        bits of ``linear_fixed_order(x, packed).to(torch.bfloat16)`` without the
        fp32 tensor (docs/architecture.md §6).
    out : torch.Tensor, optional
        Where to write the result: contiguous, of the result's shape and
        ``out_dtype`` (a kept buffer, so a long prefill's chunks do not each
        allocate one); returned.

    Raises
    ------
    ValueError
        ``x``'s width does not match the weight, ``out_dtype`` is not fp32 or
        bf16 (bf16 with ``sum_units=False``), the weight is packed for a
        pair kernel this process lacks (``pack_weight``'s ``isa``), or ``out``
        has another shape or dtype or is not contiguous.
    """
    m, k = x.shape
    if k != packed.unit_size * packed.num_units:
        raise ValueError(f"x has {k} features, the weight takes {packed.unit_size * packed.num_units}")
    if packed.amx and kernel_isa() != "amx":
        raise ValueError(f"the weight is packed for AMX tiles, this process runs the {kernel_isa()} kernels")
    out_code = DTYPE_CODES.get(out_dtype)
    if out_code is None or (out_code and not sum_units):
        raise ValueError(f"out_dtype must be float32, or bfloat16 with sum_units=True, got {out_dtype}")
    lib = _LIB or _load()
    n, u = packed.out_features, packed.num_units
    shape = (m, n) if sum_units else (u, m, n)
    if out is None:
        out = torch.empty(shape, dtype=out_dtype)
    else:
        check_out(out, shape, out_dtype, x.device)
    if m and packed.amx:
        kp, xb = packed.padded_unit_size, _pair_rows(x, packed)
        status = lib.tpguide_linear_units_amx(xb.data_ptr(), m, u * kp, packed.panels.data_ptr(), kp, u, n,
                                              out.data_ptr(), out_code, int(sum_units), _threads())
        assert status == 0, f"tpguide_linear_units_amx returned {status}"
    elif m and packed.pairs:
        if not _HAS_DPBF16:
            raise ValueError(f"the weight is packed for VDPBF16PS, this process runs the {kernel_isa()} kernels")
        _linear_pairs(x, packed, out, out_code, sum_units, PAIR_INSTRUCTIONS["VDPBF16PS"], emulate=False)
    elif m:
        xf = x.float().contiguous()
        status = lib.tpguide_linear_units(xf.data_ptr(), m, k, packed.panels.data_ptr(),
                                          DTYPE_CODES[packed.panels.dtype], packed.unit_size, u, n,
                                          out.data_ptr(), out_code, int(sum_units), _threads())
        assert status == 0, f"tpguide_linear_units returned {status}"
    return out


def _pair_rows(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """bf16 ``[M, U * K_pad]`` contiguous: ``x`` cast to bf16, each unit zero-padded to ``K_pad`` columns."""
    m, kp, u = x.shape[0], packed.padded_unit_size, packed.num_units
    xb = x.to(torch.bfloat16)
    if kp != packed.unit_size:  # zero columns up to the pair / tile width, per unit
        xb = torch.nn.functional.pad(xb.reshape(m, u, packed.unit_size), (0, kp - packed.unit_size))
    return xb.reshape(m, u * kp).contiguous()


def _linear_pairs(x: torch.Tensor, packed: PackedWeight, out: torch.Tensor, out_code: int, sum_units: bool,
                  instruction: int, emulate: bool) -> None:
    """``tpguide_linear_units_pairs`` into ``out``: the intrinsic (``emulate`` False) or its C emulation."""
    kp, u, xb = packed.padded_unit_size, packed.num_units, _pair_rows(x, packed)
    status = (_LIB or _load()).tpguide_linear_units_pairs(
        xb.data_ptr(), x.shape[0], u * kp, packed.panels.data_ptr(), kp, u, packed.out_features, out.data_ptr(),
        out_code, int(sum_units), instruction, int(emulate), _threads())
    assert status == 0, f"tpguide_linear_units_pairs returned {status}"


#: Instruction codes of ``tpguide_linear_units_pairs``.
PAIR_INSTRUCTIONS = {"VDPBF16PS": 1, "TDPBF16PS": 2}


def linear_pairs_emulated(x: torch.Tensor, packed: PackedWeight, instruction: str = "VDPBF16PS",
                          sum_units: bool = True) -> torch.Tensor:
    """:func:`linear_fixed_order` of a pair-packed bf16 weight on a plain-C emulation of ``instruction``.

    Every output element follows the Intel SDM's pseudo-code, each ``+`` one
    fp32 operation rounded to nearest even (an FMA rounds once), bf16
    denormal inputs read as zero, denormal results flushed to a zero of their
    sign, from 0 (docs/exactness.md "CPU classes"):

    * ``"VDPBF16PS"``: per k pair ``p`` ascending, ``acc = fma(x[2p+1], w[2p+1], acc)``
      then ``acc = fma(x[2p], w[2p], acc)``;
    * ``"TDPBF16PS"``: per 32-wide k tile ascending, two chains from 0 over its 16
      pairs (``e = fma(x[2p], w[2p], e)``, ``o = fma(x[2p+1], w[2p+1], o)``), then
      ``acc = acc + (e + o)``.

    Runs on every CPU; where the CPU has the instruction, the kernel in use
    gives these bits (``tests/test_kernels_bf16_pairs.py``).

    Parameters
    ----------
    x : torch.Tensor
        ``[M, U * K_unit]`` on CPU (cast to bf16).
    packed : PackedWeight
        Packed in pairs (``pack_weight(w, U, isa="avx512_bf16")`` or ``isa="amx"``;
        ``"TDPBF16PS"`` needs the AMX padding to 32).
    instruction : str
        A key of :data:`PAIR_INSTRUCTIONS`.
    sum_units : bool
        As :func:`linear_fixed_order`: fp32 ``[M, N]`` or ``[U, M, N]``.

    Raises
    ------
    ValueError
        ``packed`` is not in a pair layout (or not padded to 32 for
        ``"TDPBF16PS"``), an unknown ``instruction``, or ``x``'s width does not match.
    """
    code = PAIR_INSTRUCTIONS.get(instruction)
    if code is None:
        raise ValueError(f"instruction must be one of {sorted(PAIR_INSTRUCTIONS)}, got {instruction!r}")
    if packed.panels.dim() != 5:
        raise ValueError(f"the weight is packed for the {packed.isa} fmaf chain, not in k pairs")
    if instruction == "TDPBF16PS" and packed.padded_unit_size % 32:
        raise ValueError(f"TDPBF16PS takes 32-wide k tiles; the units are padded to {packed.padded_unit_size}")
    m, k = x.shape
    if k != packed.unit_size * packed.num_units:
        raise ValueError(f"x has {k} features, the weight takes {packed.unit_size * packed.num_units}")
    n, u = packed.out_features, packed.num_units
    out = torch.empty((m, n) if sum_units else (u, m, n), dtype=torch.float32)
    if m:
        _linear_pairs(x, packed, out, 0, sum_units, code, emulate=True)
    return out


def sum_units_fixed_order(partials: torch.Tensor, init: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 ``[U, ...] -> [...]``: ``((p[0] + p[1]) + p[2]) + ...``, the unit order, element by element.

    ``init`` (fp32, ``partials[0]``'s shape): the running sum of earlier units,
    ``((init + p[0]) + p[1]) + ...``; with ``U == 0`` the result is ``init``.
    Raises ``ValueError`` for an ``init`` of another shape, or no units and no ``init``.
    """
    p = partials.float().contiguous()
    if init is not None and init.shape != p.shape[1:]:
        raise ValueError(f"init {tuple(init.shape)} must have a unit's shape {tuple(p.shape[1:])}")
    if init is not None and not p.shape[0]:
        return init.float().clone()
    if init is None and not p.shape[0]:
        raise ValueError("no units to add and no init")
    out = torch.empty(p.shape[1:], dtype=torch.float32)
    start = None if init is None else init.float().contiguous()
    (_LIB or _load()).tpguide_sum_units(p.data_ptr(), p.shape[0], out.numel(), out.data_ptr(), threads_for(p.numel()),
                                        None if start is None else start.data_ptr())
    return out


def attention_fixed_order(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, token_seq_index: torch.Tensor,
                          token_positions: torch.Tensor, scale: float,
                          sliding_window: Optional[int] = None,
                          logit_softcap: Optional[float] = None,
                          out_dtype: torch.dtype = torch.float32,
                          max_seq_len: Optional[int] = None) -> torch.Tensor:
    """Causal attention of each query token over its sequence's cached keys, in the fixed order.

    Token ``t`` (query head ``h``, KV head ``h // (H / Hkv)``) of sequence
    ``s = token_seq_index[t]`` attends cache positions ``j`` with
    ``max(0, p - sliding_window + 1) <= j <= p``, ``p = token_positions[t]``;
    position ``j`` lives in block ``block_tables[s, j // block_size]``, row
    ``j % block_size``, and must already be written.  A dense per-slot cache
    ``[num_slots, max_model_len, Hkv, D]`` is the case ``block_size =
    max_model_len`` with ``block_tables = slots[:, None]``.  A sequence's tokens
    must be consecutive in ``q`` with ascending positions (the flattened batch).

    The order of every output element (docs/architecture.md §6): scores as fma
    chains over the head dim, a pure-arithmetic ``exp``, the softmax sum in 16
    lanes by key index then a fixed tree, ``P V`` as fma chains in key order;
    nothing depends on the other tokens, the batch, the block layout or the threads.

    Parameters
    ----------
    q : torch.Tensor
        ``[T, H, D]`` fp32 or bf16 (tokens, query heads, head dim), ``D <= 512``.
    k_cache, v_cache : torch.Tensor
        ``[num_blocks, block_size, Hkv, D]``, contiguous, ``q``'s dtype.
    block_tables : torch.Tensor
        integer ``[num_seqs, max_blocks]``: block ids of each sequence's positions.
    token_seq_index, token_positions : torch.Tensor
        integer ``[T]``: the row of ``block_tables`` and the position of each token.
    scale : float
        Multiplies ``q . k``.
    sliding_window : int, optional
    logit_softcap : float, optional
        Scores become ``cap * tanh(s / cap)`` (Gemma 2).
    out_dtype : torch.dtype
        fp32, or bf16: each fp32 output rounded at the store exactly as
        ``.to(torch.bfloat16)`` (the bits of the fp32 result cast).
    max_seq_len : int, optional
        ``max(token_positions) + 1`` when the caller knows it (the step's
        :attr:`~tpguide.model.attention.AttentionMetadata.max_seq_len`), saving a
        reduction per layer; too small a value raises the ``ValueError`` below.

    Returns
    -------
    torch.Tensor
        ``[T, H, D]`` of ``out_dtype``.

    Raises
    ------
    ValueError
        Mismatched dtypes or shapes, ``D > 512``, a position outside the block
        table (or not below ``max_seq_len``), a block id outside ``[0, num_blocks)``,
        or an ``out_dtype`` other than fp32 and bf16.
    """
    code = _dtype_code(q, "q")
    out_code = DTYPE_CODES.get(out_dtype)
    if out_code is None:
        raise ValueError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    t, h, d = q.shape
    num_blocks, block_size, hkv, dk = k_cache.shape
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype or dk != d or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not match k/v caches {tuple(k_cache.shape)} "
                         f"{k_cache.dtype} / {tuple(v_cache.shape)} {v_cache.dtype}")
    if d > MAX_HEAD_DIM or h % hkv or h // hkv > MAX_ROWS:
        raise ValueError(f"head_dim={d} (at most {MAX_HEAD_DIM}), num_heads={h} % num_kv_heads={hkv} == 0 and a "
                         f"group of at most {MAX_ROWS} query heads needed")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    tables = block_tables.to(torch.int64).contiguous()
    num_seqs, max_blocks = tables.shape
    qc = q.contiguous()
    seq = token_seq_index.to(torch.int64).contiguous()
    pos = token_positions.to(torch.int64).contiguous()
    out = torch.empty(t, h, d, dtype=out_dtype)
    if not t:
        return out
    length = int(pos.max()) + 1 if max_seq_len is None else int(max_seq_len)
    threads = _threads()
    lib = _LIB or _load()
    scratch = _attention_scratch(threads * lib.tpguide_attention_scratch_floats(length, d))
    status = lib.tpguide_attention(
        qc.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), code, tables.data_ptr(), num_seqs, max_blocks,
        block_size, num_blocks, seq.data_ptr(), pos.data_ptr(), t, h, hkv, d, length, float(scale),
        int(sliding_window or 0), float(logit_softcap or 0.0), scratch.data_ptr(), out.data_ptr(), out_code, threads)
    if status != 0:
        raise ValueError(f"token positions must lie in [0, {min(max_blocks * block_size, length)}) (max_blocks="
                         f"{max_blocks} x block_size={block_size}, max_seq_len={length}) and read blocks in "
                         f"[0, {num_blocks}), and token_seq_index in "
                         f"[0, {num_seqs}); got positions {pos.tolist()}, sequences {seq.tolist()}")
    return out


#: Largest attention scratch (fp32 values, all threads) kept between calls: 16 MiB.
SCRATCH_KEPT_FLOATS = 1 << 22


def kept_scratch(name: str, numel: int, dtype: torch.dtype, kept_numel: int) -> torch.Tensor:
    """A 1-D scratch of at least ``numel`` values of ``dtype``, kept per calling thread under ``name``.

    For kernels that write every value they read, so what a kept buffer held
    before changes nothing.  Above ``kept_numel`` the buffer is the call's own,
    not kept (a long prefill's does not stay resident).
    """
    if numel > kept_numel:
        return torch.empty(numel, dtype=dtype)
    buf = getattr(_SCRATCH, name, None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype)
        setattr(_SCRATCH, name, buf)
    return buf


def _attention_scratch(floats: int) -> torch.Tensor:
    """fp32 scratch of at least ``floats`` values for :func:`attention_fixed_order`, kept per calling thread.

    Every layer of a step asks for about the same size (it grows with the longest sequence), so one
    buffer serves them all instead of a fresh allocation of hundreds of KiB per layer
    (:func:`kept_scratch`, up to :data:`SCRATCH_KEPT_FLOATS`).
    """
    return kept_scratch("buf", floats, torch.float32, SCRATCH_KEPT_FLOATS)


def mean_square_fixed_order(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``[T, D] -> [T, 1]``: ``mean(x^2)`` per row with the fixed 16-lane dot product (any float dtype in)."""
    xf = x.float().contiguous()
    rows, d = xf.shape
    out = torch.empty(rows, 1, dtype=torch.float32)
    if rows:
        (_LIB or _load()).tpguide_mean_square(xf.data_ptr(), rows, d, out.data_ptr(), threads_for(xf.numel()))
    return out


#: Operations of :func:`unary_fixed_order` (``op`` codes of ``tpguide_unary``).
UNARY_OPS = {"silu": 0, "gelu_tanh": 1, "softcap": 2, "cos": 3, "sin": 4}


def unary_fixed_order(x: torch.Tensor, op: str, param: float = 0.0) -> torch.Tensor:
    """fp32, ``x``'s shape: ``op`` (a :data:`UNARY_OPS` name) of every element, the same bits wherever it sits.

    ``"softcap"`` is ``param * tanh(x / param)``.  Raises ``KeyError`` for an unknown ``op``.
    """
    code = UNARY_OPS[op]
    xf = x.float().contiguous()
    out = torch.empty_like(xf)
    if xf.numel():
        (_LIB or _load()).tpguide_unary(xf.data_ptr(), xf.numel(), code, float(param), out.data_ptr(),
                                        threads_for(xf.numel()))
    return out
