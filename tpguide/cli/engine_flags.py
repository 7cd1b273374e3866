"""The engine flags shared by ``launch/generate.py`` and ``launch/serve.py``, and the config they build."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

# tpguide before torch: its package init sets libgomp's spin count, which libgomp reads when torch loads it
from tpguide.dist.group import DEFAULT_TIMEOUT_S
from tpguide.engine import EngineConfig
from tpguide.model.dtype import DTYPES, checkpoint_dtype, resolve_dtype

if TYPE_CHECKING:
    import torch


def add_engine_flags(p: argparse.ArgumentParser, default_max_new_tokens: int = 64) -> None:
    p.add_argument("--model", help="local Hugging Face directory (config.json, *.safetensors, tokenizer) or a "
                                   "FILE.gguf of a supported architecture (converted once to the cache); "
                                   "default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--max-new-tokens", type=int, default=default_max_new_tokens,
                   help=f"max_tokens of requests that do not set it (default {default_max_new_tokens})")
    p.add_argument("--max-num-seqs", type=int, default=16,
                   help="requests running at once: request slots, bitmask rows; not tied to the KV memory "
                        "(default 16)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default 16)")
    p.add_argument("--kv-cache-memory", type=_bytes, default=None, metavar="BYTES",
                   help="KV-cache pool per rank, in bytes (suffixes KiB, MiB, GiB); default: on CUDA "
                        "--kv-cache-memory-fraction of the free memory, on CPU room for --max-num-seqs "
                        "requests of --max-model-len tokens.  The pool is allocated once; its size is printed")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=0.9,
                   help="CUDA, without --kv-cache-memory: share of the free device memory the KV pool takes "
                        "(default 0.9)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse the cached KV blocks of a shared prompt prefix (default: reuse them)")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024,
                   help="token budget per step; longer prompts are prefilled in chunks (default 1024)")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="prompt + generated tokens per request (default 2048)")
    p.add_argument("--guided-backend", choices=["auto", "xgrammar", "llguidance"], default="auto",
                   help="grammar engine; auto: per request xgrammar when it enforces every keyword the guide "
                        "uses, else llguidance, else the request is refused (default auto)")
    p.add_argument("--json-whitespace", choices=["compact", "bounded", "any"], default="bounded",
                   help="whitespace between JSON tokens: none, at most 12 characters in a row, or any amount "
                        "(default bounded); a request's structured_output.json_whitespace overrides it")
    p.add_argument("--grammar-compile-timeout", type=float, default=60.0, metavar="S",
                   help="fail a request whose guide takes longer than S seconds to check and compile (compiles "
                        "run in a worker thread while the batch keeps stepping; default 60)")
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="weights and activations; logits are fp32.  auto (the default): on CPU bfloat16 if "
                        "the CPU has AVX2 + FMA (with --no-tp-invariant: AVX512_BF16 or AMX), else float32; on CUDA "
                        "as vLLM's: a 16-bit checkpoint's own dtype, bfloat16 for a float32 one (float16 "
                        "before compute capability 8.0)")
    p.add_argument("--no-tp-invariant", dest="tp_invariant", action="store_false",
                   help="the plain, fastest mode: library GEMMs and attention and a plain all-reduce, so logits "
                        "(and then tokens) may change with the tp size, the batch, speculation or the threads "
                        "(default: every reduction in a fixed order, see docs/exactness.md)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="on CUDA (the default): persistent step buffers without host syncs, and at tp 1 with the "
                        "TP-invariant model a CUDA graph replayed per token-count bucket; the first 2 steps of each "
                        "bucket are checked bit for bit against the eager step, which a difference or a failed "
                        "capture falls back to (docs/gpu.md).  --no-cuda-graphs: every step eagerly")
    p.add_argument("--enforce-eager", dest="cuda_graphs", action="store_false",
                   help="vLLM's name for --no-cuda-graphs")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads per rank (default: cores // ranks on this node); with the default TP-invariant "
                        "mode the outputs do not depend on it")
    p.add_argument("--seed", type=int, default=0,
                   help="run seed; a request without 'seed' uses seed * 1000003 + its index (default 0)")
    p.add_argument("--speculative-method", choices=["grammar", "ngram", "draft-head", "none"], default="grammar",
                   help="draft tokens verified by the model each decode step; output tokens are the same as "
                        "without them.  grammar (the default): guided requests draft the text their grammar "
                        "forces, unguided ones do not draft; ngram (prompt lookup) and draft-head (the model's "
                        "first layers + a pruned vocab-parallel LM head) draft every request, and are the "
                        "fallback of guided requests where nothing is forced; none: no drafts")
    p.add_argument("--no-grammar-draft", dest="grammar_draft", action="store_false",
                   help="no forced-text drafts: with ngram or draft-head, that drafter alone; with grammar "
                        "(the default), no drafts at all, as --speculative-method none")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="most drafts per request per step, 1..16 (default 4)")
    p.add_argument("--draft-num-layers", type=int, default=None,
                   help="draft-head: target layers the drafter runs (default: a third, rounded up)")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="draft-head: token ids the draft LM head predicts, the first ids + the stop tokens "
                        "(default 8192)")
    p.add_argument("--no-draft-lens", dest="draft_lens", action="store_false",
                   help="draft-head: no tuned-lens translator after the drafter's last layer (by default one "
                        "is fitted on built-in calibration text at the first start, about 15 s for the "
                        "embedded model on 2 CPU cores, and cached)")
    p.add_argument("--reasoning-parser", choices=["auto", "qwen3", "deepseek_r1", "none"], default="auto",
                   help="think block of reasoning models (docs/reasoning.md): auto = on when the tokenizer has "
                        "<think> and </think> as single tokens; a named parser without them fails the start")
    p.add_argument("--data-parallel-size", type=int, default=None, metavar="D",
                   help="replicas: the torchrun world splits into D tensor-parallel groups of world / D ranks, "
                        "each a full engine; global rank 0 is the front end (default: 1, or world / "
                        "--tensor-parallel-size)")
    p.add_argument("--tensor-parallel-size", type=int, default=None, metavar="T",
                   help="ranks per replica (default: world / --data-parallel-size); e.g. torchrun --nnodes D "
                        "--nproc-per-node T ... --tensor-parallel-size T")
    p.add_argument("--collective-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds a rank waits in a collective before failing (default {DEFAULT_TIMEOUT_S:g}); "
                        "a dead rank is noticed sooner (closed sockets, torchrun's agent)")


def set_threads(args: argparse.Namespace, tp_size: int) -> int:
    """Set torch's intra-op threads of this rank from ``--threads`` (default ``cores // ranks``, at least 1).

    ``ranks`` is the ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``; ``tp_size`` without it).

    Raises ``ValueError`` naming the value if ``--threads`` is below 1.
    """
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", tp_size))
    threads = args.threads or max(1, (os.cpu_count() or 1) // local_ranks)
    import torch

    torch.set_num_threads(threads)
    return threads


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The :class:`EngineConfig` of the flags; ValueError on flags that would be ignored or are out of range.

    ``--dtype auto`` resolves for CUDA when a GPU is visible (vLLM's choice:
    16-bit checkpoints keep their dtype, fp32 ones run in bf16), else for
    this CPU (:func:`tpguide.model.dtype.resolve_dtype`).
    """
    used = [flag for flag, on in (("--draft-num-layers", args.draft_num_layers is not None),
                                  ("--draft-vocab-size", args.draft_vocab_size is not None),
                                  ("--no-draft-lens", not args.draft_lens)) if on]
    if used and args.speculative_method != "draft-head":
        raise ValueError(f"{', '.join(used)} {'needs' if len(used) == 1 else 'need'} --speculative-method "
                         f"draft-head, got --speculative-method {args.speculative_method}")
    if args.collective_timeout <= 0:
        raise ValueError(f"--collective-timeout must be > 0, got {args.collective_timeout}")
    method = None if args.speculative_method == "none" else args.speculative_method
    if method == "grammar" and not args.grammar_draft:
        method = None
    if method is None and args.num_speculative_tokens is not None:
        raise ValueError(f"--num-speculative-tokens {args.num_speculative_tokens} needs drafts, got "
                         f"--speculative-method {args.speculative_method}"
                         f"{'' if args.grammar_draft else ' --no-grammar-draft'}")
    return EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, block_size=args.block_size,
                        kv_cache_memory=args.kv_cache_memory,
                        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                        enable_prefix_caching=args.enable_prefix_caching, guided_backend=args.guided_backend,
                        json_whitespace=args.json_whitespace, grammar_compile_timeout_s=args.grammar_compile_timeout,
                        seed=args.seed, dtype=_dtype(args), tp_invariant=args.tp_invariant,
                        speculative_method=method, grammar_draft=args.grammar_draft,
                        num_speculative_tokens=args.num_speculative_tokens, draft_num_layers=args.draft_num_layers,
                        draft_vocab_size=args.draft_vocab_size or EngineConfig.draft_vocab_size,
                        draft_lens=args.draft_lens, cuda_graphs=args.cuda_graphs,
                        reasoning_parser=args.reasoning_parser)


_BYTE_UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "B": 1}


def _bytes(text: str) -> int:
    """``"512MiB"`` -> 536870912; a plain integer is bytes (argparse type)."""
    for unit, factor in _BYTE_UNITS.items():
        if text.endswith(unit):
            number = text[:-len(unit)].strip()
            try:
                return int(float(number) * factor)
            except ValueError:
                break
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes (an integer, or a number with KiB / MiB / GiB), "
                                         f"got {text!r}") from None


def _dtype(args: argparse.Namespace) -> torch.dtype:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    on_cuda_auto = args.dtype == "auto" and device == "cuda" and args.model and not str(args.model).endswith(".gguf")
    return resolve_dtype(args.dtype, device, checkpoint_dtype(args.model) if on_cuda_auto else None,
                         fixed_order=args.tp_invariant)
