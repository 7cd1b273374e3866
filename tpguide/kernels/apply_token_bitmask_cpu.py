"""C CPU path of :func:`tpguide.kernels.apply_token_bitmask_inplace`.

The kernel is ``csrc/apply_token_bitmask_cpu.c`` (plain C99): one pass over the
words of each row, skipping an all-ones word with one comparison (as
xgrammar's CPU kernel does), storing 32 ``-inf`` for an all-zeros word without
reading the logits, and a vectorised select otherwise.  It is compiled on
first use with the system C compiler into a cache and called through
``ctypes`` (which releases the GIL during the call).

Cache: ``$TPGUIDE_CACHE/kernels`` (else ``~/.cache/tpguide/kernels``); the
file name carries a hash of the source, the compiler, its flags and the
machine, so an edit or another toolchain never loads a stale library.  The
library is written to a temporary name and renamed into place, so concurrent
processes (pytest-xdist workers, TP ranks) may compile at once.  Portable
flags only (no ``-march=native``): a cache on a shared home directory must
load on every machine of the same architecture.

When no compiler works, :func:`load_cpu_kernel` returns ``None`` (the reason
is logged once at debug level and kept in :func:`cpu_kernel_error`) and the
dispatcher's ``"auto"`` uses the torch path.
"""

from __future__ import annotations

import array
import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from pathlib import Path

import torch

from tpguide.cache import cache_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "apply_token_bitmask_cpu.c"
CFLAGS = ("-O3", "-std=c99", "-shared", "-fPIC", "-fno-strict-aliasing")
SYMBOL = "tpguide_apply_token_bitmask"
#: dtype codes of the C kernel.
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
COMPILE_TIMEOUT_S = 120

_LOCK = threading.Lock()
#: ``None`` before the first load, else ``(kernel or None, error or None)``.
_STATE: tuple | None = None

#: Entries of the int64 parameter array the C entry point takes (its ``enum param``).
NUM_PARAMS = 14

def cache_dir() -> Path:
    """``$TPGUIDE_CACHE/kernels`` if the variable is set, else ``~/.cache/tpguide/kernels``."""
    return cache_root() / "kernels"


def compiler() -> list[str]:
    """The C compiler command: ``$CC``, else Python's configured ``CC``, else ``cc``."""
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc"):
        argv = shlex.split(candidate or "")
        if argv and shutil.which(argv[0]):
            return [shutil.which(argv[0]), *argv[1:]]
    raise RuntimeError("no C compiler found (tried $CC, sysconfig CC and cc)")


def library_path(cc: list[str]) -> Path:
    """Cache file for this source, compiler, flags and machine."""
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(repr((cc, CFLAGS, platform.machine(), platform.system())).encode())
    return cache_dir() / f"apply_token_bitmask_cpu-{key.hexdigest()[:16]}.so"


def build_library() -> Path:
    """Compile the kernel into the cache unless it is there; return the library's path.

    Raises
    ------
    RuntimeError
        No compiler, or the compiler failed (its output is in the message).
    OSError
        The cache directory cannot be written.
    """
    cc = compiler()
    path = library_path(cc)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        proc = subprocess.run([*cc, *CFLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(cc)} exited with {proc.returncode}: "
                               f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)  # atomic: a reader sees no file or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load_cpu_kernel():
    """The C kernel as a ``ctypes`` function, compiled on first call; ``None`` if unavailable."""
    global _STATE
    if _STATE is None:
        with _LOCK:
            if _STATE is None:
                try:
                    library = ctypes.CDLL(str(build_library()))
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
