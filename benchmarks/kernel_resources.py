"""Compile every Triton kernel a GPU step launches, per model family, for a CUDA arch, without a GPU.

docs/gpu.md, "Compiling for a GPU without one".  For each family of
:data:`FAMILIES` (the head geometry of a real checkpoint: query / KV heads,
head dim, window, soft-caps, q/k norms; small hidden and vocabulary sizes,
which no kernel's constexprs depend on beyond the norm's chunk), at its
dtype, this writes a two-layer random checkpoint, loads it on CPU, and
inside :func:`tpguide.kernels.compile_only.compile_only` runs the CUDA
graphs' capture steps (:func:`~tpguide.worker.cuda_graphs.forward_logits`
on the step buffers' padding-only inputs of buckets 1, 8 and 16), the
bitmask kernel on their logits, and the sampler's row reductions (fp32
and fp64).
Every launch is compiled for ``sm_<arch>`` and skipped.

It prints one line per distinct compiled kernel: registers per thread,
local memory (spills), shared memory per block, tensor-core instructions,
and the constexprs that tell variants apart; then a status line.  Exit
status 1 when a kernel fails to compile, uses more shared memory than the
arch allows (:data:`tpguide.kernels.compile_only.SHARED_MEMORY_LIMIT`), has
an atomic instruction (whose order would depend on scheduling), or takes
TF32 operands in IEEE mode; spills are reported, not failed.

Usage::

    python benchmarks/kernel_resources.py [--arch 90] [--families smollm2-fp32,gemma2-bf16,...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

#: name -> (architecture, config overrides, dtype): real checkpoints' head geometry, small widths
FAMILIES = {
    "smollm2-fp32": ("LlamaForCausalLM", dict(num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                              hidden_size=576), torch.float32),  # the embedded model, `--dtype float32`
    "smollm2-bf16": ("LlamaForCausalLM", dict(num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                              hidden_size=576), torch.bfloat16),
    "llama3-bf16": ("LlamaForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                             hidden_size=1024), torch.bfloat16),  # Llama 3 8B: 32 / 8 x 128
    "mistral-fp16": ("MistralForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                                hidden_size=1024), torch.float16),
    "qwen2-bf16": ("Qwen2ForCausalLM", dict(num_attention_heads=7, num_key_value_heads=1, head_dim=128,
                                            hidden_size=896), torch.bfloat16),  # Qwen2 7B: 28 / 4 x 128
    "qwen3-bf16": ("Qwen3ForCausalLM", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                            hidden_size=1024), torch.bfloat16),
    "phi3-bf16": ("Phi3ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=96,
                                          hidden_size=384), torch.bfloat16),  # Phi-3 mini: 32 / 32 x 96
    "gemma2-bf16": ("Gemma2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                                              hidden_size=1024), torch.bfloat16),  # Gemma 2 9B: 16 / 8 x 256
    "gemma3-bf16": ("Gemma3ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                                              hidden_size=1024), torch.bfloat16),  # Gemma 3 4B: 8 / 4 x 256
}
VOCAB, BLOCK_SIZE = 512, 16


def _config(arch: str, overrides: dict):
    """The family's tiny config with ``overrides``; Phi-3's longrope factors sized for its head dim."""
    from tpguide.model.random_checkpoint import tiny_hf_config

    extra = dict(overrides, intermediate_size=256, num_hidden_layers=2)
    if arch == "Phi3ForCausalLM":
        half = int(overrides["head_dim"] * 0.75) // 2
        extra["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                    "short_factor": [1.0] * half, "long_factor": [2.0] * half,
                                    "original_max_position_embeddings": 16}
    return tiny_hf_config(arch, VOCAB, **extra)


def compile_family(name: str, arch: int) -> list:
    """The launches of one family's graph steps and sampler kernels, compiled for ``sm_<arch>``.

    The steps are the graphs' capture steps (padding only, buckets 1, 8 and
    16): a captured graph launches exactly these kernels with these
    arguments for every real step of its bucket (``tests/test_cuda_graph_capture.py``).
    """
    from tpguide.dist import TPGroup
    from tpguide.kernels.apply_token_bitmask import apply_token_bitmask_inplace
    from tpguide.kernels.compile_only import compile_only
    from tpguide.kernels.row_reductions_triton import cumsum_rows, logsumexp_rows
    from tpguide.model.loader import load_model
    from tpguide.model.random_checkpoint import write_random_model
    from tpguide.worker.cuda_graphs import forward_logits
    from tpguide.worker.step_inputs import StepBuffers, StepCapacity

    family, overrides, dtype = FAMILIES[name]
    d = write_random_model(Path(tempfile.mkdtemp()), _config(family, overrides), seed=1)
    model = load_model(d, TPGroup(), dtype=dtype)
    model.allocate_kv_cache(16, BLOCK_SIZE, max_model_len=64)
    buffers = StepBuffers(StepCapacity(max_tokens=16, max_seqs=4, max_blocks_per_seq=4, block_size=BLOCK_SIZE),
                          torch.device("cpu"))
    with compile_only(arch) as launches:
        for bucket in (1, 8, 16):
            buffers.stage_padding(bucket)
            logits = forward_logits(model, buffers.padding_views(bucket))  # [bucket, V_local] fp32
            words = torch.zeros((bucket, model.vocab_shard.bitmask_size), dtype=torch.int32)
            apply_token_bitmask_inplace(logits, words, token_mask=torch.ones(bucket, dtype=torch.int32),
                                        backend="triton")
        for rows_dtype in (torch.float32, torch.float64):
            x = torch.zeros((4, 40), dtype=rows_dtype)
            logsumexp_rows(x)
            cumsum_rows(x)
    return launches


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 + minor (90: H100/H200, 80: A100)")
    p.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    from tpguide.kernels.compile_only import SHARED_MEMORY_LIMIT

    names = [n for n in args.families.split(",") if n]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        p.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    limit = SHARED_MEMORY_LIMIT.get(args.arch)
    failed, seen = [], set()
    print(f"{'family':14s} {'kernel':32s} {'regs':>4s} {'spill B':>7s} {'shared B':>8s} {'mma':>4s}  constexprs")
    for name in names:
        try:
            launches = compile_family(name, args.arch)
        except Exception as e:  # a kernel that does not compile: name it, go on with the others
            failed.append(f"{name}: {type(e).__name__}: {str(e)[:400]}")
            print(f"{name:14s} COMPILE FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        for launch in launches:
            key = getattr(launch.compiled, "hash", None) or (launch.kernel_name, repr(launch.constexprs))
            if key in seen:
                continue
            seen.add(key)
            r, ptx = launch.resources(), launch.ptx_counts()
            consts = " ".join(f"{k}={v}" for k, v in launch.constexprs.items())
            print(f"{name:14s} {launch.kernel_name:32s} {r['registers']:4d} {r['local']:7d} {r['shared']:8d} "
                  f"{ptx['mma']:4d}  {consts}", flush=True)
            if limit is not None and r["shared"] > limit:
                failed.append(f"{name}: {launch.kernel_name} needs {r['shared']} B of shared memory, "
                              f"sm_{args.arch} allows {limit}")
            if ptx["atomics"]:
                failed.append(f"{name}: {launch.kernel_name} has {ptx['atomics']} atomic instructions")
            if launch.constexprs.get("IEEE") and ptx["tf32"]:
                failed.append(f"{name}: {launch.kernel_name} in IEEE mode has {ptx['tf32']} TF32 operands")
    print(f"sm_{args.arch}: {len(seen)} distinct kernels compiled for {len(names)} families; "
          + ("all within the arch's limits" if not failed else f"{len(failed)} FAILED:\n  " + "\n  ".join(failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
