"""Every Triton kernel of a GPU step compiles for sm_90 in its CUDA form, within the arch's limits (docs/gpu.md).

Within the limits: shared memory the arch allows, no atomic instruction
(an accumulation whose order depends on scheduling), no TF32 operand in a
kernel asked for IEEE fp32 products.

No GPU needed: ``benchmarks/kernel_resources.py`` runs the CUDA graphs'
capture steps of three families with the most different head geometries
(the embedded model in fp32, ``--dtype float32``: GQA groups of 3 and
``tl.dot`` in IEEE fp32; Gemma 2 in bf16: head dim 256, soft-caps,
window; Phi-3 in bf16: head dim 96 padded to 128, no grouping) under
:func:`tpguide.kernels.compile_only.compile_only`, in a child process
without ``TRITON_INTERPRET``; Triton compiles through its own ``ptxas``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("_paged_attention_kernel", "_bmm_fixed_tiling_kernel", "_add_rms_norm_kernel",
           "_apply_token_bitmask_kernel", "_logsumexp_rows_kernel", "_cumsum_rows_kernel", "_rotary_kernel",
           "_silu_and_mul_kernel", "_sum_units_kernel")


def _nvidia_backend() -> bool:
    try:
        import triton.backends.nvidia as nvidia
    except ImportError:
        return False
    return os.path.exists(os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas"))


@pytest.mark.skipif(not _nvidia_backend(), reason="this Triton has no NVIDIA backend with ptxas")
def test_step_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "benchmarks/kernel_resources.py", "--arch", "90",
                           "--families", "smollm2-fp32,gemma2-bf16,phi3-bf16"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    assert "all within the arch's limits" in out, out[-2000:]
    for family in ("smollm2-fp32", "gemma2-bf16", "phi3-bf16"):
        assert f"{family} " in out, out
    for kernel in KERNELS:
        assert f" {kernel} " in out, (kernel, out)
    attention = [line for line in out.splitlines() if "_paged_attention_kernel" in line]
    assert attention and all("ON_CUDA=True" in line for line in attention), attention  # the tl.dot form
    assert any("HEAD_DIM=96 D_P=128" in line for line in attention), attention
    assert any("HAS_SOFTCAP=True" in line and "HEAD_DIM=256" in line for line in attention), attention
    rotary = [line for line in out.splitlines() if "_rotary_kernel" in line]
    assert any("HEAD_DIM=96 ROTARY_DIM=72" in line for line in rotary), rotary  # Phi-3's partial rotary
    assert all("WRITE_CACHE=True" in line for line in rotary), rotary  # the KV write rides on the RoPE launch


def test_compile_only_refuses_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    code = ("from tpguide.kernels.compile_only import compile_only\n"
            "try:\n    compile_only().__enter__()\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert "refused: compile_only() needs TRITON_INTERPRET unset" in proc.stdout, proc.stdout + proc.stderr
