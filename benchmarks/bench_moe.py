"""Benchmark a mixture of experts: guided tokens/s against the dense model of the same active size, and memory per rank.

Two random-weight checkpoints with SmolLM2's tokenizer (vocabulary 49 152),
written once into ``--out-dir`` (``AutoModelForCausalLM.from_config``, bf16):

* **moe**: ``Qwen3MoeForCausalLM``, hidden 512, 8 layers, 8 query / 4 KV
  heads of 64, 16 experts of width ``--expert-width`` (512), top-2, every
  layer sparse;
* **dense**: ``Qwen3ForCausalLM`` of the same shape with one MLP of width
  ``2 x --expert-width``: the same active parameters per token.

Per batch size in ``--batch-sizes`` (8, 32): JSON-schema-guided chat
requests (greedy, ``--max-tokens``) through the default engine at tp 1 in
this process (grammar drafts on), after a warm-up with other prompts;
generated tokens per second of wall time, fastest of ``--repeats`` runs, the
two models interleaved; then one decode step's time (forward and LM head
over ``n`` rows, fastest of 40, the two models alternated step by step:
the figure a shared machine disturbs least).  Then, per rank at tp 1 and 2 (gloo): bytes of the expert weights,
of all parameters, and the peak RSS of the rank after loading.

vLLM is not installed on the machines this was written on, so its CPU build
is not measured here (``benchmarks/bench_vs_vllm.py`` compares dense models
where it is).

Usage::

    python benchmarks/bench_moe.py [--batch-sizes 8,32] [--max-tokens 32] [--repeats 2] [--threads 2]
                                   [--expert-width 512] [--out-dir /tmp/tpguide-bench-moe] [--no-memory]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from bench_generate import _peak_rss_bytes, _rss_bytes, request_dicts
from engine_runs import warm_up_variant

from tpguide.dist.spawn import run_on_ranks

SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             max_position_embeddings=4096, vocab_size=49152, tie_word_embeddings=True, initializer_range=0.05)


def write_checkpoints(out_dir: Path, expert_width: int) -> dict:
    """``{"moe": dir, "dense": dir}``, written unless already there."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    from tpguide.model.default_model import default_model_dir
    from tpguide.model.random_checkpoint import _special_token_ids, write_random_model

    tok = default_model_dir()
    special = _special_token_ids(tok)
    configs = {
        "moe": Qwen3MoeConfig(**SHAPE, **special, intermediate_size=2 * expert_width, num_experts=16,
                              num_experts_per_tok=2, moe_intermediate_size=expert_width, norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=[]),
        "dense": Qwen3Config(**SHAPE, **special, intermediate_size=2 * expert_width),
    }
    dirs = {}
    for name, config in configs.items():
        d = out_dir / f"{name}-w{expert_width}"
        if not (d / "config.json").is_file():
            write_random_model(d, config, seed=0, tokenizer_dir=tok, dtype=torch.bfloat16)
        dirs[name] = str(d)
    return dirs


def tokens_per_second(model_dir: str, n: int, max_tokens: int) -> tuple[float, int, int]:
    """(generated tokens / s, tokens, outputs that stopped) of one timed guided run of ``n`` requests at tp 1."""
    from engine_runs import run_engine

    from tpguide.engine import EngineConfig

    dicts = request_dicts(n, max_tokens, guided=True)
    outputs, wall = run_engine(model_dir, EngineConfig(max_num_seqs=n, dtype=torch.bfloat16), dicts, max_tokens,
                               warm_up=warm_up_variant(dicts))
    bad = [o["error"] for o in outputs if o["finish_reason"] == "error"]
    if bad:
        raise RuntimeError(f"a request failed: {bad[0]}")
    tokens = sum(len(o["token_ids"]) for o in outputs)
    return tokens / wall, tokens, sum(o["finish_reason"] == "stop" for o in outputs)


def decode_step_ms(model_dirs: dict, n: int, iterations: int = 40) -> dict:
    """``{name: fastest decode step in ms}``: ``n`` rows forward + LM head, the models alternated step by step.

    Alternating and taking the fastest of ``iterations`` steps keeps a shared
    machine's bursts of load out of the ratio.
    """
    from tpguide.dist import TPGroup
    from tpguide.model.attention import AttentionMetadata
    from tpguide.model.invariant_reduce import prepack_weights
    from tpguide.model.loader import load_model

    models = {}
    for name, d in model_dirs.items():
        models[name] = load_model(d, TPGroup(), torch.bfloat16)
        prepack_weights(models[name])
        models[name].allocate_kv_cache(n, 64)
    meta = AttentionMetadata.from_lists(list(range(n)), [1] * n, [32] * n)
    ids = torch.randint(0, SHAPE["vocab_size"], (n,), generator=torch.Generator().manual_seed(0))
    best = {name: float("inf") for name in models}
    for i in range(iterations + 2):
        for name, model in models.items():
            start = time.perf_counter()
            model.compute_logits(model(ids, meta.token_positions, meta))
            if i >= 2:  # two warm-up steps
                best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def memory_on_rank(group, model_dir: str) -> dict:
    """This rank's bf16 shard: expert bytes, parameter bytes, RSS before and peak after loading."""
    from tpguide.model.loader import load_model
    from tpguide.model.moe import expert_weight_bytes

    before = _rss_bytes()
    model = load_model(model_dir, group, torch.bfloat16)
    params = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    return {"experts": expert_weight_bytes(model), "params": params, "rss_before": before, "peak": _peak_rss_bytes()}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="8,32")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--expert-width", type=int, default=512)
    p.add_argument("--out-dir", default="/tmp/tpguide-bench-moe")
    p.add_argument("--no-memory", action="store_true", help="skip the per-rank memory at tp 1 and 2")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dirs = write_checkpoints(Path(args.out_dir), args.expert_width)
    print(f"moe: Qwen3-MoE hidden 512, 8 layers, 16 experts of {args.expert_width}, top-2; dense: Qwen3 with "
          f"MLP {2 * args.expert_width} (same active size); bf16, tp 1, {args.threads} threads, "
          f"--max-tokens {args.max_tokens}, guided JSON, default engine (grammar drafts)")
    print("vLLM: not installed here, not measured")
    print(f"{'requests':>8} {'moe tok/s':>10} {'dense tok/s':>12} {'moe/dense':>9}   tokens (stopped) moe | dense")
    for n in (int(b) for b in args.batch_sizes.split(",")):
        best = {name: (0.0, 0, 0) for name in dirs}
        for _ in range(args.repeats):
            for name, d in dirs.items():  # interleaved: the machine may be shared
                run = tokens_per_second(d, n, args.max_tokens)
                best[name] = max(best[name], run)
        (m, mt, ms), (dn, dt, ds) = best["moe"], best["dense"]
        print(f"{n:>8} {m:>10.1f} {dn:>12.1f} {m / dn:>9.2f}   {mt} ({ms}) | {dt} ({ds})")
        sys.stdout.flush()
    print("one decode step (forward + LM head, fastest of 40, the models alternated), ms")
    print(f"{'rows':>8} {'moe':>10} {'dense':>12} {'moe/dense':>9}")
    for n in (int(b) for b in args.batch_sizes.split(",")):
        best = decode_step_ms(dirs, n)
        m, dn = best["moe"], best["dense"]
        print(f"{n:>8} {m:>10.2f} {dn:>12.2f} {m / dn:>9.2f}")
    if not args.no_memory:
        print("per rank, bf16: expert weights, all parameters, peak RSS - RSS before loading (MiB)")
        for tp in (1, 2):
            for rank, mem in enumerate(run_on_ranks(memory_on_rank, tp, dirs["moe"], timeout_s=600)):
                print(f"  tp {tp} rank {rank}: experts {mem['experts'] / 2**20:.1f}, params "
                      f"{mem['params'] / 2**20:.1f}, RSS growth {(mem['peak'] - mem['rss_before']) / 2**20:.1f}")
    print(json.dumps({"args": vars(args)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
