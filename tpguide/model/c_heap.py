"""The C heap's settings for a rank's life: glibc's malloc thresholds fixed at start-up, trims after big frees.

docs/benchmarks.md, "Weights held once".  glibc serves an allocation under
its mmap threshold from the heap, and raises that threshold (up to 32 MiB)
each time a mapped block is freed.  A rank's big temporaries (the packing's
panels, a prefill's activations and gathered partials: a few MiB to tens of
MiB each) then land in the heap after the first ones, and the freed holes
stay resident until a trim: on the ~1 B benchmark at tp 2, a prefill left
about 0.25 GiB free but resident on each rank.  :func:`tune_c_heap` fixes the
thresholds instead (the values of glibc's ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` environment variables): blocks of
:data:`MMAP_THRESHOLD_BYTES` and more are mapped and unmapped on free, and
the heap's top is handed back past :data:`TRIM_THRESHOLD_BYTES` of free
space.  Allocation sizes change nothing computed, so no output bit changes.

Elsewhere than glibc (musl, macOS) there is no ``mallopt`` / ``malloc_trim``
to call: nothing is done and the functions return False.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional

__all__ = ["MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "glibc", "trim_c_heap", "tune_c_heap"]

#: Blocks of this size and more are mapped on their own (glibc's ``M_MMAP_THRESHOLD``; fixing it turns off the
#: dynamic raise).  On the ~1 B benchmark at tp 2 it took a rank's peak from about 1,860 to 1,650 MiB at the
#: same speed; 1 MiB saved about 90 MiB more but made tp 2 about 30 % slower (docs/benchmarks.md).
MMAP_THRESHOLD_BYTES = 8 * 2**20
#: Free space at the heap's top handed back to the system past this (glibc's ``M_TRIM_THRESHOLD``).
TRIM_THRESHOLD_BYTES = 64 * 2**20
#: ``mallopt`` parameter numbers, from glibc's ``malloc.h``.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: The environment variables glibc reads at its first allocation; one the user set wins over this module.
ENV_NAMES = {M_TRIM_THRESHOLD: "MALLOC_TRIM_THRESHOLD_", M_MMAP_THRESHOLD: "MALLOC_MMAP_THRESHOLD_"}


@functools.lru_cache(maxsize=1)
def glibc() -> Optional[ctypes.CDLL]:
    """The process's glibc (with ``mallopt`` and ``malloc_trim``), or None under another C library."""
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on (no ldconfig subprocess)
        for name in ("gnu_get_libc_version", "mallopt", "malloc_trim"):  # musl has no gnu_get_libc_version
            getattr(libc, name)
    except (OSError, AttributeError):
        return None
    return libc


def tune_c_heap() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (:data:`MMAP_THRESHOLD_BYTES`,
    :data:`TRIM_THRESHOLD_BYTES`); a threshold set through its environment variable is kept.

    Call it once at start-up, before the weights load (every rank's
    :func:`~tpguide.engine.startup.build_engine` does); calling it again
    changes nothing.  Returns False where glibc is absent (nothing done).
    """
    libc = glibc()
    if libc is None:
        return False
    for param, value in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        if ENV_NAMES[param] not in os.environ:
            libc.mallopt(param, value)
    return True


def trim_c_heap() -> bool:
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim(0)``); False where there is none."""
    libc = glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
