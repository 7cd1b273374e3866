"""Compile a C source of ``tpguide/kernels/csrc`` on first use and load it with ``ctypes``.

Cache: ``$TPGUIDE_CACHE/kernels`` (else ``~/.cache/tpguide/kernels``); the file
name carries a hash of the source, the compiler, its flags and the machine, so
an edit or another toolchain never loads a stale library.  The library is
written to a temporary name and renamed into place, so concurrent processes
(pytest-xdist workers, TP ranks) may compile at once.  Instruction-set flags
are chosen by the caller and are part of the key, so a cache on a shared home
directory never hands one CPU a library built for another.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from typing import Sequence

from tpguide.cache import cache_root

CSRC = Path(__file__).resolve().parent / "csrc"
COMPILE_TIMEOUT_S = 120


def cache_dir() -> Path:
    """``$TPGUIDE_CACHE/kernels`` if the variable is set, else ``~/.cache/tpguide/kernels``."""
    return cache_root() / "kernels"


def compiler() -> list[str]:
    """The C compiler command: ``$CC``, else Python's configured ``CC``, else ``cc``.

    Raises
    ------
    RuntimeError
        If none of them is on ``PATH``.
    """
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc"):
        argv = shlex.split(candidate or "")
        if argv and shutil.which(argv[0]):
            return [shutil.which(argv[0]), *argv[1:]]
    raise RuntimeError("no C compiler found (tried $CC, sysconfig CC and cc)")


def local_includes(source: Path) -> list[Path]:
    """The files ``source`` includes by ``#include "name"`` from its own folder, in order (not recursive)."""
    return [source.parent / name for name in re.findall(r'^\s*#\s*include\s*"([^"]+)"', source.read_text(), re.M)]


def library_path(source: Path, cc: Sequence[str], cflags: Sequence[str]) -> Path:
    """Cache file for this source (and the local files it includes), compiler, flags and machine."""
    key = hashlib.sha256()
    key.update(source.read_bytes())
    for included in local_includes(source):
        key.update(included.read_bytes())
    key.update(repr((list(cc), list(cflags), platform.machine(), platform.system())).encode())
    return cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"


def build_library(source: Path, cflags: Sequence[str]) -> Path:
    """Compile ``source`` with ``cflags`` into the cache unless it is there; return the library's path.

    Raises
    ------
    RuntimeError
        No compiler, or the compiler failed (its output is in the message).
    OSError
        The cache directory cannot be written.
    """
    cc = compiler()
    path = library_path(source, cc, cflags)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        proc = subprocess.run([*cc, *cflags, "-o", tmp, str(source)], capture_output=True, text=True,
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


def load_library(source: Path, cflags: Sequence[str]) -> ctypes.CDLL:
    """:func:`build_library`, then ``ctypes.CDLL`` of it (raises as :func:`build_library`, or ``OSError``)."""
    return ctypes.CDLL(str(build_library(source, cflags)))
