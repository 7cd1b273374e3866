"""A decode step's kernel count on the CUDA code path does not grow back: one decoder layer, and the greedy sampler.

Runs ``benchmarks/kernel_counts.py`` (docs/gpu.md "Kernels per decoder
layer") on the tiny shape in a child process, which sets
``TRITON_INTERPRET=1`` before any kernel is defined: a decoder layer
launches 2 norms, 4 fixed-tiling matmuls, 1 RoPE + KV write, 1 paged
attention, 2 unit sums and 1 SiLU-and-mul, and nothing else; a greedy step
without logprobs samples in 9 device ops.  Counts, not times.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
LAYER = {"_add_rms_norm_kernel": 2, "_bmm_fixed_tiling_kernel": 4, "_paged_attention_kernel": 1, "_rotary_kernel": 1,
         "_silu_and_mul_kernel": 1, "_sum_units_kernel": 2}


def test_a_decoder_layer_and_the_greedy_sampler_launch_what_the_docs_say():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "benchmarks/kernel_counts.py", "--shape", "tiny", "--rows", "8"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    layer = next(line for line in lines if line.startswith("forward, one decoder layer"))
    assert ast.literal_eval(layer[layer.index("{"):]) == LAYER, layer
    assert "per layer: 11 kernels" in proc.stdout, proc.stdout
    assert "sampler, 8 rows, greedy: 9 device ops" in proc.stdout, proc.stdout
