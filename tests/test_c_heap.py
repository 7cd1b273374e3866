"""glibc's malloc thresholds fixed at start-up (tpguide/model/c_heap.py), kept when the user set them, and
nothing done without glibc."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpguide.model import c_heap

REPO = Path(__file__).resolve().parents[1]

#: In a fresh process: free a 32 MiB block first (glibc then raises its dynamic mmap threshold past 12 MiB),
#: tune, and print whether a 12 MiB block is mapped on its own (mallinfo2's mapped bytes grow by it).
PROBE = """
import ctypes
from tpguide.model import c_heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = c_heap.glibc()
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
libc.free(libc.malloc(32 << 20))
print(c_heap.tune_c_heap(), c_heap.tune_c_heap())
before = libc.mallinfo2().hblkhd
block = libc.malloc(12 << 20)
print(libc.mallinfo2().hblkhd - before >= 12 << 20)
libc.free(block)
print(c_heap.trim_c_heap())
"""


def _probe(**env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    environ.update(env, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", PROBE], env=environ, capture_output=True, text=True, check=True)
    return out.stdout.split()


@pytest.mark.skipif(c_heap.glibc() is None, reason="glibc's mallopt is what is tested; this C library has none")
def test_tuned_threshold_maps_a_block_the_dynamic_one_would_not():
    assert _probe() == ["True", "True", "True", "True"]
    # a threshold the user set through glibc's variable is kept: the 12 MiB block stays in the heap
    assert _probe(MALLOC_MMAP_THRESHOLD_=str(64 << 20)) == ["True", "True", "False", "True"]


def test_without_glibc_nothing_is_called(monkeypatch):
    monkeypatch.setattr(c_heap, "glibc", lambda: None)
    assert c_heap.tune_c_heap() is False
    assert c_heap.trim_c_heap() is False
