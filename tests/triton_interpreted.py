"""Run a test module's Triton cases under ``TRITON_INTERPRET=1`` in a child process (no tests of its own).

Triton reads the variable when a kernel is decorated, so it cannot be
switched on inside a pytest worker that may already hold the compiled
kernel, and it must not leak into CUDA tests.  A kernel test module keeps
its cases in a ``{name: case(device)}`` dict, calls :func:`run_cases` from
its ``__main__`` block and :func:`check_in_child` from its CPU test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

TESTS = Path(__file__).resolve().parent


def check_in_child(script: str, names: Sequence[str], timeout_s: float = 300) -> None:
    """Run ``python script NAME...`` interpreted on CPU; assert it ran every named case without error."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS.parent), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, script, *names], env=env, cwd=TESTS.parent, capture_output=True,
                          text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"passed {len(names)} cases" in proc.stdout, proc.stdout[-4000:]


def _index_scalars_of_any_shape() -> None:
    """Let the interpreter of triton < 3.7 use a scalar argument as a loop bound under numpy >= 2.4.

    That interpreter holds a scalar kernel argument as a numpy array of shape
    ``(1,)`` and converts it with ``int(array)``, which numpy 2.4 refuses
    ("only 0-dimensional arrays can be converted to Python scalars"); so
    ``range(0, D, BLOCK)`` failed there.  Triton 3.7+ squeezes the array
    first; this gives the older interpreter the same ``__index__``.
    """
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "squeezes_index", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.squeezes_index = True
    interpreter._patch_lang_tensor = patched


def run_cases(cases: Dict[str, Callable[[str], None]], names: Optional[Sequence[str]] = None) -> None:
    """The child's side: each named case (default: all, or those on the command line) on ``"cpu"``."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    _index_scalars_of_any_shape()
    chosen = list(names if names is not None else sys.argv[1:] or cases)
    for name in chosen:
        cases[name]("cpu")
        print(f"ok {name}", flush=True)
    print(f"passed {len(chosen)} cases")
