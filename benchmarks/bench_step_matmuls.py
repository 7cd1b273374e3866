"""A decoder layer's matmuls per row count: the fixed-order kernels against oneDNN, one run.

For the embedded SmolLM2-135M-Instruct's shapes (or ``--model``'s config) at
tp 1: ``qkv_proj``, ``o_proj`` (one reduction unit per head), ``gate_up_proj``,
``down_proj`` (the invariant reduction units) and the LM head (up to 64 rows), at each row
count of ``--rows`` (decode batches, verify passes, prefill chunks), in
``--dtype``, with ``--threads`` intra-op threads on both sides:

* **fixed**: :func:`tpguide.kernels.fixed_order_cpu.linear_fixed_order` on
  weights packed once (the TP-invariant default, docs/architecture.md §6);
* **F.linear**: torch's library GEMM on the plain weight (the ``--no-tp-invariant`` mode);
* **oneDNN prepacked**: ``torch.ops.mkldnn._linear_pointwise`` on a weight
  reordered once for the row count (``_reorder_linear_weight``), as vLLM's CPU
  build does; skipped where this torch build lacks the op;
* **fmaf tile** (bf16 on a class with its own pair order, ``VDPBF16PS`` or
  ``TDPBF16PS``): the same kernel library's fmaf-chain tile on weights packed
  for ``avx512`` (the bf16 path before the pair kernels: the before / after
  of the pair kernel in one run).

Each timing is the fastest of ``--repeats`` interleaved runs (a shared
machine slows all three alike); the ratios are the result.  Prints the CPU
model and the instruction the fixed-order kernel runs on, with its class
(``VDPBF16PS (avx512_bf16)``, ``TDPBF16PS (amx)``, ``VFMADD231PS zmm (avx512)``, ...).

Usage::

    python benchmarks/bench_step_matmuls.py [--rows 1,8,32,256,1024] [--dtype bfloat16] [--threads 1]
                                            [--repeats 5] [--model DIR]
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from tpguide.kernels.fixed_order_cpu import (
    OWN_BF16_ORDER_ISAS,
    kernel_isa,
    linear_fixed_order,
    matmul_instruction,
    pack_weight,
)
from tpguide.model.config import ModelConfig
from tpguide.model.default_model import default_model_dir
from tpguide.model.invariant_reduce import reduction_block_size


def cpu_model() -> str:
    """``lscpu``'s model name from ``/proc/cpuinfo`` (the platform string where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def layer_shapes(config: ModelConfig) -> List[Tuple[str, int, int, int]]:
    """``(name, out_features N, in_features K, reduction units U)`` of one decoder layer + the LM head at tp 1."""
    h, d = config.hidden_size, config.head_dim
    q, kv, i = config.num_attention_heads * d, config.num_key_value_heads * d, config.intermediate_size
    return [("qkv_proj", q + 2 * kv, h, 1), ("o_proj", h, q, config.num_attention_heads),
            ("gate_up_proj", 2 * i, h, 1), ("down_proj", h, i, i // reduction_block_size(i, 1)),
            ("lm_head", config.org_vocab_size, h, 1)]


def onednn_prepacked(w: torch.Tensor, rows: int) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """``x -> x @ w.T`` through oneDNN on a weight reordered once for ``rows``; None where unavailable."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        fn = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
        fn(torch.zeros(rows, w.shape[1], dtype=w.dtype))
        return fn
    except (AttributeError, RuntimeError):
        return None


def fastest(fns: Dict[str, Callable[[], object]], repeats: int) -> Dict[str, float]:
    """Milliseconds of each callable: the fastest of ``repeats`` interleaved runs, after one warm-up each."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF model directory; default: the embedded SmolLM2")
    parser.add_argument("--rows", default="1,8,32,256,1024")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    config = ModelConfig.from_pretrained(args.model or default_model_dir())
    print(f"CPU {cpu_model()}; fixed-order kernel: {matmul_instruction(dtype)}; torch {torch.__version__}; "
          f"{args.dtype}, {args.threads} thread(s)")
    fmaf = dtype == torch.bfloat16 and kernel_isa() in OWN_BF16_ORDER_ISAS
    print(f"{'rows':>5} | {'matmul':12} | {'fixed ms':>9} | {'F.linear ms':>11} | {'oneDNN ms':>9} | "
          f"{'fixed/F.linear':>14} | {'fixed/oneDNN':>12}" + (f" | {'fmaf ms':>8} | {'fmaf/oneDNN':>11}" if fmaf else ""))
    gen = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        totals = {"fixed": 0.0, "F.linear": 0.0, "oneDNN": 0.0, "fmaf": 0.0}
        for name, n, k, units in layer_shapes(config):
            if name == "lm_head" and rows > 64:  # a prefill chunk samples from its last row only
                continue
            w = (torch.randn(n, k, generator=gen) * 0.02).to(dtype)
            x = torch.randn(rows, k, generator=gen).to(dtype)
            packed = pack_weight(w, units)
            fns: Dict[str, Callable[[], object]] = {"fixed": lambda: linear_fixed_order(x, packed),
                                                    "F.linear": lambda: F.linear(x, w)}
            if fmaf:
                chain = pack_weight(w, units, isa="avx512")
                fns["fmaf"] = lambda: linear_fixed_order(x, chain)
            prepacked = onednn_prepacked(w, rows)
            if prepacked is not None:
                fns["oneDNN"] = lambda: prepacked(x)
            ms = fastest(fns, args.repeats)
            if name != "lm_head":
                for key in totals:
                    totals[key] += ms.get(key, float("nan"))
            one = ms.get("oneDNN", float("nan"))
            print(f"{rows:5d} | {name:12} | {ms['fixed']:9.3f} | {ms['F.linear']:11.3f} | {one:9.3f} | "
                  f"{ms['fixed'] / ms['F.linear']:14.2f} | {ms['fixed'] / one:12.2f}"
                  + (f" | {ms['fmaf']:8.3f} | {ms['fmaf'] / one:11.2f}" if fmaf else ""))
        print(f"{rows:5d} | {'layer total':12} | {totals['fixed']:9.3f} | {totals['F.linear']:11.3f} | "
              f"{totals['oneDNN']:9.3f} | {totals['fixed'] / totals['F.linear']:14.2f} | "
              f"{totals['fixed'] / totals['oneDNN']:12.2f}"
              + (f" | {totals['fmaf']:8.3f} | {totals['fmaf'] / totals['oneDNN']:11.2f}" if fmaf else ""))
    print("(ratio < 1: the fixed-order kernel is faster; layer total = the four decoder matmuls, LM head apart)")


if __name__ == "__main__":
    main()
