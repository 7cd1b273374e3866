"""The exactness class: the kernel path and instruction set that fix an output's bits (docs/receipts.md).

Two runs in the same class, with the same model fingerprint, dtype and
sampling parameters, give the same token ids and logprob bits at any tp size,
batch, thread count and speculation (docs/exactness.md).  Two runs in
different classes may differ.

CPU: the class follows :func:`tpguide.kernels.fixed_order_cpu.kernel_isa`,
the instruction set the fixed-order kernels were built for (the kernel
selection itself, AMX falling back to AVX-512 where the OS refuses the tile
state):

================================  ==========================================
ISA (dtype)                       class
================================  ==========================================
default, avx2, avx512 (any dtype) ``cpu-fixed-order``: fmaf chains, the same
                                  bits on every x86-64 CPU (the vector code
                                  repeats the scalar IEEE operations)
amx (fp32)                        ``cpu-fixed-order`` (AVX-512 fmaf chains)
amx (bf16)                        ``cpu-amx``: one ``TDPBF16PS`` per k tile,
                                  the hardware's order inside a tile
avx512_bf16 (fp32)                ``cpu-fixed-order``
avx512_bf16 (bf16)                ``cpu-avx512bf16``: ``VDPBF16PS``'s own pair
                                  order (where the kernels build that tile)
an ISA not in these tables        ``cpu-<isa>``: a class of its own until it
                                  is shown to equal another
================================  ==========================================

A new kernel ISA joins :data:`FMA_CHAIN_ISAS` (it repeats the fmaf chains)
or :data:`TILE_CLASSES` (a hardware tile with its own order, keyed by
``(isa, dtype name)``).

CUDA: ``cuda-fixed-order-sm<major><minor>``, the fixed-tiling Triton kernels
compiled for that architecture (docs/gpu.md); the CUDA path forced on CPU
tensors (tests, :mod:`tpguide.kernels.triton_path`) is ``cpu-triton-interpreter``.

Without ``tp_invariant`` the row-parallel layers sum with a plain all-reduce
and the bits change with the tp size: the class is ``<device>-not-invariant-tp<N>``.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

__all__ = ["FMA_CHAIN_ISAS", "TILE_CLASSES", "cpu_exactness_class", "exactness_class"]

#: Kernel ISAs whose every dtype runs the portable code's fmaf chains (the same bits), apart from
#: the pairs of :data:`TILE_CLASSES`.
FMA_CHAIN_ISAS = frozenset({"default", "avx2", "avx512", "avx512_bf16", "amx"})
#: ``(isa, dtype name) -> class`` where an instruction fixes its own order of additions.
TILE_CLASSES: Dict[Tuple[str, str], str] = {("amx", "bfloat16"): "cpu-amx",
                                            ("avx512_bf16", "bfloat16"): "cpu-avx512bf16"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_exactness_class(isa: str, dtype: torch.dtype) -> str:
    """The class of the fixed-order CPU kernels built for ``isa`` running ``dtype`` (see the module table)."""
    tile = TILE_CLASSES.get((isa, _dtype_name(dtype)))
    if tile is not None:
        return tile
    return "cpu-fixed-order" if isa in FMA_CHAIN_ISAS else f"cpu-{isa}"


def exactness_class(device: torch.device, dtype: torch.dtype, tp_invariant: bool, tp_size: int,
                    *, isa: Optional[str] = None, triton_forced: Optional[bool] = None) -> str:
    """The exactness class of an engine on ``device`` (see the module docstring).

    Parameters
    ----------
    device : torch.device
        Where the model runs.
    dtype : torch.dtype
        Weights and activations.
    tp_invariant : bool
        The engine's TP-invariant reductions.
    tp_size : int
        Named in the class only without ``tp_invariant``.
    isa : str, optional
        The CPU kernels' ISA; default :func:`~tpguide.kernels.fixed_order_cpu.kernel_isa`
        (the kernel selection's own answer).
    triton_forced : bool, optional
        The CUDA path forced on CPU; default :func:`~tpguide.kernels.triton_path.triton_path_forced`.
    """
    if not tp_invariant:
        return f"{device.type}-not-invariant-tp{tp_size}"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda-fixed-order-sm{major}{minor}"
    if triton_forced is None:
        from tpguide.kernels.triton_path import triton_path_forced

        triton_forced = triton_path_forced()
    if triton_forced:
        return "cpu-triton-interpreter"
    if isa is None:
        from tpguide.kernels.fixed_order_cpu import kernel_isa

        isa = kernel_isa()
    return cpu_exactness_class(isa, dtype)
