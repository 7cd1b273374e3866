"""One switch for the model's CUDA code path: :func:`use_triton` is true on CUDA tensors, or everywhere when forced.

Every branch of the model and sampler that picks the batch-invariant Triton
kernels asks ``use_triton(x)`` instead of ``x.is_cuda``.  Tests force the
path on CPU tensors (:func:`forced_triton_path`, or ``TPGUIDE_TRITON_PATH=1``
in the environment) with ``TRITON_INTERPRET=1``, so the code that runs on a
GPU is the code the CPU suite checks.  Elementwise transcendental ops
(rotary's cos/sin, activations, soft-caps) still choose by device: on CPU
torch's vectorized loops round a tensor's tail differently from its body,
so there the scalar fixed-order kernels keep them position-independent;
on CUDA torch's elementwise kernels compute every element alike.
docs/gpu.md, "Exactness on CUDA".
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch

_forced = os.environ.get("TPGUIDE_TRITON_PATH") == "1"
#: set by :func:`tpguide.kernels.compile_only.compile_only`: launches compile for CUDA and run nothing
_compile_only = False


def use_triton(x: torch.Tensor) -> bool:
    """Whether ``x`` takes the CUDA code path: it lives on CUDA, or the path is forced (tests)."""
    return x.is_cuda or _forced


def compiles_for_cuda(x: torch.Tensor) -> bool:
    """Whether a kernel launched on ``x`` takes its compiled CUDA form (``tl.dot``, dimensions padded to 16).

    True for a CUDA tensor, and inside :func:`tpguide.kernels.compile_only.compile_only`
    (CPU tensors, nothing runs); the interpreter gets the other form.
    """
    return x.is_cuda or _compile_only


def triton_path_forced() -> bool:
    """Whether the CUDA code path is forced on every device (:func:`forced_triton_path`)."""
    return _forced


@contextmanager
def forced_triton_path() -> Iterator[None]:
    """Run the CUDA code path on CPU tensors inside the block (kernels interpreted, or only compiled).

    Raises
    ------
    RuntimeError
        ``TRITON_INTERPRET=1`` is not set (outside ``compile_only``): Triton
        cannot run a kernel on CPU tensors without its interpreter, and the
        variable is read when the kernels are defined (set it before
        importing tpguide's kernels).
    """
    global _forced
    if os.environ.get("TRITON_INTERPRET") != "1" and not _compile_only:
        raise RuntimeError("forced_triton_path() needs TRITON_INTERPRET=1 in the environment before the kernels "
                           f"are imported, got TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}")
    before, _forced = _forced, True
    try:
        yield
    finally:
        _forced = before
