"""Compile tpguide's Triton kernels for a CUDA GPU on a machine without one, and read their resource usage.

docs/gpu.md, "Compiling for a GPU without one".  Inside :func:`compile_only`
every Triton launch (``kernel[grid](...)``) is compiled for CUDA
``sm_<arch>`` from the launch's real arguments (the same signature,
specialisations and constexprs as on a GPU: the wrappers pick the compiled
CUDA form, :func:`tpguide.kernels.triton_path.compiles_for_cuda`) and then
skipped: no kernel runs, outputs stay as allocated.  With the CUDA code path
forced (:func:`tpguide.kernels.triton_path.forced_triton_path`), a model's
forward on CPU tensors compiles exactly the kernels it would launch on a GPU.

Triton compiles through its own LLVM and the ``ptxas`` its wheel ships; no
CUDA driver is needed.  :meth:`CompiledLaunch.resources` reads the cubin's
registers, stack, local (spill) memory and static shared memory with the
wheel's ``cuobjdump``; the dynamic shared memory comes from the compile
metadata.  A GPU may still refuse what compiled here: occupancy, and limits
checked at launch beyond shared memory (:data:`SHARED_MEMORY_LIMIT`), are
not modelled.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, List

import torch

__all__ = ["SHARED_MEMORY_LIMIT", "CompiledLaunch", "compile_only"]

#: most shared memory one block may use (bytes, opt-in) by compute capability: CUDA C Programming Guide,
#: "Technical Specifications per Compute Capability"
SHARED_MEMORY_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024,
                       120: 99 * 1024}


@dataclass
class CompiledLaunch:
    """One launch compiled under :func:`compile_only`.

    Attributes
    ----------
    kernel_name : str
        The ``@triton.jit`` function's name.
    grid : tuple of int
        The launch's grid (programs per axis).
    constexprs : dict
        The launch's ``tl.constexpr`` keyword arguments.
    compiled : triton.compiler.CompiledKernel
        Its ``asm`` holds ``ptx`` and ``cubin``; ``metadata.shared`` is the
        dynamic shared memory in bytes.
    """

    kernel_name: str
    grid: tuple
    constexprs: Dict[str, object]
    compiled: object

    def resources(self) -> Dict[str, int]:
        """``{"registers", "stack", "local", "shared"}`` per thread / per block, in registers and bytes.

        ``local`` > 0 means register spills; ``shared`` is the larger of the
        cubin's static and the launch's dynamic shared memory.

        Raises
        ------
        RuntimeError
            The Triton wheel ships no ``cuobjdump``, or its output has no resource line.
        """
        tool = os.path.join(_nvidia_bin(), "cuobjdump")
        if not os.path.exists(tool):
            raise RuntimeError(f"no cuobjdump in {_nvidia_bin()}: this Triton wheel cannot report resources")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(self.compiled.asm["cubin"])
            f.flush()
            out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
        if m is None:
            raise RuntimeError(f"no resource line in cuobjdump's output for {self.kernel_name}: {out[:500]}")
        regs, stack, shared, local = (int(g) for g in m.groups())
        return {"registers": regs, "stack": stack, "local": local,
                "shared": max(shared, int(self.compiled.metadata.shared))}


    def ptx_counts(self) -> Dict[str, int]:
        """Instructions of the PTX that bear on exactness: ``{"atomics", "tf32", "mma"}`` counts.

        ``atomics``: ``atom.`` / ``red.`` (an atomic accumulation's order
        depends on scheduling: none may appear on the exact path); ``tf32``:
        any TF32 operand (a fp32 product in IEEE mode must have none);
        ``mma``: tensor-core instructions (``mma`` / ``wgmma``).
        """
        ptx = self.compiled.asm["ptx"]
        return {"atomics": len(re.findall(r"\b(?:atom|red)\.", ptx)), "tf32": ptx.count("tf32"),
                "mma": len(re.findall(r"\b(?:wgmma|mma)\.", ptx))}


def _nvidia_bin() -> str:
    import triton.backends.nvidia as nvidia

    return os.path.join(os.path.dirname(nvidia.__file__), "bin")


class _TargetOnlyDriver:
    """Triton's active-driver interface, enough to compile for ``target`` with no device (no launch)."""

    def __init__(self, target) -> None:
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@contextmanager
def compile_only(arch: int = 90) -> Iterator[List[CompiledLaunch]]:
    """Compile every Triton launch in the block for CUDA ``sm_<arch>``, run none; yields the launches (in order).

    The CUDA code path is forced for the block, so the model's forward on
    CPU tensors launches (compiles) the kernels a GPU would run.  Outputs of
    skipped launches are left as allocated: read nothing from them.

    Parameters
    ----------
    arch : int
        Compute capability times ten plus minor (90: H100 / H200; 80: A100).

    Raises
    ------
    RuntimeError
        ``TRITON_INTERPRET=1`` is set (the kernels are interpreter functions
        then, which cannot be compiled), or the Triton wheel has no NVIDIA
        backend.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_only() needs TRITON_INTERPRET unset: interpreted kernels cannot be compiled")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction
        _nvidia_bin()
    except ImportError as e:
        raise RuntimeError(f"this Triton has no NVIDIA backend to compile with: {e}") from e
    from tpguide.kernels import triton_path

    launches: List[CompiledLaunch] = []
    run = JITFunction.run

    def compile_launch(kernel, *args, grid, warmup, **kwargs):
        compiled = run(kernel, *args, grid=grid, warmup=True, **kwargs)
        constexprs = {p.name: kwargs[p.name] for p in kernel.params if p.is_constexpr and p.name in kwargs}
        launches.append(CompiledLaunch(kernel.fn.__name__, tuple(grid) if not callable(grid) else (), constexprs,
                                       compiled))
        return compiled

    saved = (triton_path._compile_only, triton_path._forced)
    saved_driver = getattr(driver, "_active", None)  # not driver.active: that would look for a GPU
    driver.set_active(_TargetOnlyDriver(GPUTarget("cuda", arch, 32)))
    JITFunction.run = compile_launch
    triton_path._compile_only = triton_path._forced = True
    try:
        yield launches
    finally:
        triton_path._compile_only, triton_path._forced = saved
        JITFunction.run = run
        driver.set_active(saved_driver)
