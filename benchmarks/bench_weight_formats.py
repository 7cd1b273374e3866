"""Measure before choosing a weight format: the decoder's matmuls per step in fp32, bf16 and int4.

The embedded SmolLM2-135M's per-layer matmuls (``qkv_proj`` 960x576,
``o_proj`` 576x576, ``gate_up_proj`` 3072x576, ``down_proj`` 576x1536, 30
layers; the LM head is left out) at ``--rows`` rows, random weights, one
thread by default:

* fp32 and bf16: ``F.linear``;
* int4: group-32 weights through ``torch._weight_int4pack_mm_for_cpu`` with
  bf16 activations (fp16/fp32 activations take a ~35x slower path there).

The formats are interleaved over ``--repeats`` rounds and the median counts;
on a shared machine compare the ratios, not the milliseconds.  Prints the
CPU capability torch sees and whether it has native bf16 (AVX512_BF16/AMX).

Usage::

    python benchmarks/bench_weight_formats.py [--rows 1,8,32] [--threads 1] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from tpguide.model.dtype import cpu_has_native_bf16
from tpguide.model.int4_linear import Int4Weight

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) per layer
NUM_LAYERS = 30


def _layer_calls(rows: int, fmt: str) -> list:
    calls = []
    for out, inp in SHAPES:
        w, x = torch.randn(out, inp) * 0.05, torch.randn(rows, inp)
        if fmt == "int4":
            q = torch.randint(0, 16, (out, inp), dtype=torch.int32)
            weight = Int4Weight(q, torch.rand(out, inp // 32) * 0.01, torch.randn(out, inp // 32) * 0.01)
            xb = x.bfloat16()
            calls.append(lambda weight=weight, xb=xb: weight.matmul(xb))
        else:
            dt = torch.float32 if fmt == "fp32" else torch.bfloat16
            wd, xd = w.to(dt), x.to(dt)
            calls.append(lambda wd=wd, xd=xd: F.linear(xd, wd))
    return calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32", help="comma-separated rows per matmul (default 1,8,32)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, native bf16: {cpu_has_native_bf16()}, "
          f"{args.threads} thread(s); ms per decode step of matmuls (30 layers), median of {args.repeats}")
    print(f"{'rows':>5} {'fp32':>8} {'bf16':>8} {'int4':>8} {'bf16/fp32':>10} {'int4/fp32':>10}")
    for rows in [int(r) for r in args.rows.split(",")]:
        calls = {fmt: _layer_calls(rows, fmt) for fmt in ("fp32", "bf16", "int4")}
        times: dict = {fmt: [] for fmt in calls}
        for _ in range(args.repeats):
            for fmt, layer in calls.items():
                t = time.perf_counter()
                for _ in range(NUM_LAYERS):
                    for call in layer:
                        call()
                times[fmt].append(1e3 * (time.perf_counter() - t))
        med = {fmt: statistics.median(v) for fmt, v in times.items()}
        print(f"{rows:>5} {med['fp32']:>8.1f} {med['bf16']:>8.1f} {med['int4']:>8.1f} "
              f"{med['bf16'] / med['fp32']:>10.2f} {med['int4'] / med['fp32']:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
