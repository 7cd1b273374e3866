"""``--dtype auto``: the weight and activation dtype that fits the machine.

* CPU with the fixed-order kernels (the default, TP-invariant mode): bfloat16
  when the CPU has AVX2 + FMA or better.  The kernels widen bf16 weights to
  fp32 exactly and keep the same fma chain, so bf16 only halves the weight
  traffic: on an AVX2-only AMD EPYC it generated the vLLM fixtures 1.39x
  (8 requests) and 1.23x (32) faster than fp32 (docs/benchmarks.md,
  "Which dtype auto picks").  Without AVX2 + FMA (the portable C loops):
  float32.
* CPU with plain torch matmuls (``--no-tp-invariant``): bfloat16 only where
  the CPU has native bf16 matmul (AVX512_BF16 or AMX); without it the GEMM
  converts bf16 to fp32 in software and bf16 is slower than fp32.
* CUDA: vLLM's ``dtype="auto"``: a 16-bit checkpoint keeps its dtype
  (``config.json`` ``dtype`` / ``torch_dtype``); a float32 checkpoint, or
  one that names none (the embedded GGUF), runs in bfloat16, and in float16
  on a GPU without bf16 (before compute capability 8.0, where a bfloat16
  checkpoint becomes float16 too).  fp32 weights would run the fixed-order
  matmuls on FMAs instead of tensor cores (docs/gpu.md, "Compiling for a
  GPU without one") at twice the weight traffic; logits stay fp32 either
  way.  ``--dtype float32`` loads a checkpoint at fp32.

Explicit names (``"float32"``, ``"bfloat16"``, ``"float16"``) are taken as given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

#: The names ``--dtype`` accepts besides ``"auto"``.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Spellings of config.json's dtype field.
_CONFIG_DTYPES = {**DTYPES, "float": torch.float32, "half": torch.float16, "bf16": torch.bfloat16,
                  "fp32": torch.float32, "fp16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """True if this CPU multiplies bf16 in hardware (AVX512_BF16 or AMX tiles), per torch's cpuinfo."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def cuda_has_bf16(device: torch.device | str) -> bool:
    """True if the CUDA ``device`` computes in bfloat16 (compute capability 8.0+); True when no GPU is visible."""
    if not torch.cuda.is_available():
        return True
    return torch.cuda.get_device_capability(torch.device(device)) >= (8, 0)


def checkpoint_dtype(model_dir: str | Path) -> Optional[torch.dtype]:
    """The dtype ``model_dir/config.json`` declares (``dtype``, or the older ``torch_dtype``); None if none.

    Raises
    ------
    ValueError
        If ``config.json`` is missing or names a dtype not in :data:`DTYPES`.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json in model directory {str(model_dir)!r}")
    raw = json.loads(path.read_text())
    name = raw.get("dtype") or raw.get("torch_dtype")
    if name is None:
        return None
    if str(name) not in _CONFIG_DTYPES:
        raise ValueError(f"config.json dtype {name!r} is not one of {sorted(_CONFIG_DTYPES)}")
    return _CONFIG_DTYPES[str(name)]


def cpu_has_avx2_fma() -> bool:
    """True if this CPU has AVX2 and FMA (the fixed-order kernels' vector tiles, ``/proc/cpuinfo``)."""
    from tpguide.kernels.fixed_order_cpu import choose_isa, cpu_flags

    return choose_isa(cpu_flags(), None) != "default"


def resolve_dtype(name: str, device: torch.device | str, checkpoint: Optional[torch.dtype] = None,
                  fixed_order: bool = True) -> torch.dtype:
    """The model dtype for ``--dtype name`` on ``device``.

    Parameters
    ----------
    name : str
        ``"auto"`` or a key of :data:`DTYPES`.
    device : torch.device or str
        Where the model runs (only the type matters).
    checkpoint : torch.dtype, optional
        The checkpoint's own dtype (:func:`checkpoint_dtype`); used by
        ``"auto"`` on CUDA (module docstring).
    fixed_order : bool
        The model runs the fixed-order CPU kernels (``tp_invariant``, the
        default); False: plain torch matmuls.  Used by ``"auto"`` on CPU.

    Raises
    ------
    ValueError
        For an unknown ``name`` (lists the valid ones).
    """
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {name!r}")
        return DTYPES[name]
    if torch.device(device).type == "cuda":
        if not cuda_has_bf16(device):
            return torch.float16
        return checkpoint if checkpoint in (torch.bfloat16, torch.float16) else torch.bfloat16
    if cpu_has_native_bf16() or (fixed_order and cpu_has_avx2_fma()):
        return torch.bfloat16
    return torch.float32
