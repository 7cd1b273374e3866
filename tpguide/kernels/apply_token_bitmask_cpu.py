"""C CPU path of :func:`tpguide.kernels.apply_token_bitmask_inplace`.

The kernel is ``csrc/apply_token_bitmask_cpu.c`` (plain C99): one pass over the
words of each row, skipping an all-ones word with one comparison (as
xgrammar's CPU kernel does), storing 32 ``-inf`` for an all-zeros word without
reading the logits, and a vectorised select otherwise.  It is compiled on
first use with the system C compiler into a cache and called through
``ctypes`` (which releases the GIL during the call).

Compiled and cached by :mod:`tpguide.kernels.c_library`.  Portable
flags only (no ``-march=native``): a cache on a shared home directory must
load on every machine of the same architecture.

When no compiler works, :func:`load_cpu_kernel` returns ``None`` (the reason
is logged once at debug level and kept in :func:`cpu_kernel_error`) and the
dispatcher's ``"auto"`` uses the torch path.
"""

from __future__ import annotations

import array
import ctypes
import logging
import subprocess
import threading

import torch

from tpguide.kernels.c_library import CSRC, load_library

logger = logging.getLogger(__name__)

SOURCE = CSRC / "apply_token_bitmask_cpu.c"
CFLAGS = ("-O3", "-std=c99", "-shared", "-fPIC", "-fno-strict-aliasing")
SYMBOL = "tpguide_apply_token_bitmask"
#: dtype codes of the C kernel.
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_LOCK = threading.Lock()
#: ``None`` before the first load, else ``(kernel or None, error or None)``.
_STATE: tuple | None = None

#: Entries of the int64 parameter array the C entry point takes (its ``enum param``).
NUM_PARAMS = 14


def load_cpu_kernel():
    """The C kernel as a ``ctypes`` function, compiled on first call; ``None`` if unavailable."""
    global _STATE
    if _STATE is None:
        with _LOCK:
            if _STATE is None:
                try:
                    library = load_library(SOURCE, CFLAGS)
                    num_params = library[SYMBOL + "_num_params"]()
                    if num_params != NUM_PARAMS:
                        raise RuntimeError(f"the C kernel takes {num_params} parameters, expected {NUM_PARAMS}")
                    kernel = library[SYMBOL]
                    kernel.argtypes = (ctypes.c_void_p,)
                    kernel.restype = ctypes.c_int
                    _STATE = (kernel, None)
                except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                    _STATE = (None, f"{type(err).__name__}: {err}")
                    logger.debug("C CPU bitmask kernel unavailable, using the torch path: %s", _STATE[1])
    return _STATE[0]


def cpu_kernel_error() -> str | None:
    """Why :func:`load_cpu_kernel` returned ``None`` (``None`` if it loaded or was not tried)."""
    return None if _STATE is None else _STATE[1]


def apply_token_bitmask_inplace_cpu(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    *,
    token_mask: torch.Tensor | None = None,
    d2t: torch.Tensor | None = None,
    draft_vocab_start_index: int = 0,
) -> None:
    """Set disallowed logits to ``-inf`` in place with the compiled C kernel.

    Arguments are assumed valid (the dispatcher checks them); see
    :func:`tpguide.kernels.apply_token_bitmask_inplace` for the contract.
    Logits whose last dimension is not contiguous go to the torch path.

    Parameters
    ----------
    logits : torch.Tensor
        ``[num_rows, width]`` float32/float16/bfloat16 on CPU, any row stride; in place.
    bitmask : torch.Tensor
        ``[num_rows, num_words]`` int32 words on CPU, any strides.
    token_mask : torch.Tensor, optional
        ``[num_rows]`` int32; rows where it is 0 are neither read nor written.
    d2t : torch.Tensor, optional
        ``[width]`` int32 draft-to-target offsets; ``bitmask`` is then the full row.
    draft_vocab_start_index : int
        First global draft id of this shard (tokens).

    Raises
    ------
    ValueError
        ``logits`` is not on CPU.
    RuntimeError
        The C kernel cannot be built (see :func:`cpu_kernel_error`).
    """
    if logits.device.type != "cpu":
        raise ValueError(f"the cpu backend needs CPU tensors, got logits on {logits.device}")
    kernel = _STATE[0] if _STATE is not None else load_cpu_kernel()
    if kernel is None:
        raise RuntimeError(f"the C CPU bitmask kernel is unavailable: {cpu_kernel_error()}")
    num_rows, width = logits.shape
    logits_row_stride, logits_col_stride = logits.stride()
    if logits_col_stride != 1 and width > 1:
        from tpguide.kernels.apply_token_bitmask_torch import apply_token_bitmask_inplace_torch

        apply_token_bitmask_inplace_torch(logits, bitmask, token_mask=token_mask, d2t=d2t,
                                          draft_vocab_start_index=draft_vocab_start_index)
        return
    bitmask_row_stride, bitmask_col_stride = bitmask.stride()
    params = array.array("q", (  # the C kernel's enum param, in order
        logits.data_ptr(), DTYPE_CODES[logits.dtype], num_rows, width, logits_row_stride,
        bitmask.data_ptr(), bitmask.shape[1], bitmask_row_stride, bitmask_col_stride,
        0 if token_mask is None else token_mask.data_ptr(), 0 if token_mask is None else token_mask.stride(0),
        0 if d2t is None else d2t.data_ptr(), 0 if d2t is None else d2t.stride(0), draft_vocab_start_index,
    ))
    status = kernel(params.buffer_info()[0])
    assert status == 0, f"C kernel returned {status} for dtype {logits.dtype}"
