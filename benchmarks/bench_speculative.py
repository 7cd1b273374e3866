"""Benchmark speculative decoding on the built-in demo: plain vs grammar vs ngram vs draft-head, in one run.

``grammar`` is the default (guided requests draft their forced text), and
``ngram`` / ``draft-head`` run with it in front.  Every configuration runs the demo requests of ``launch/generate.py`` (every
guide type, an unguided and a seeded sampled request) at tp 1 in this
process, after one warm-up run.  Printed per configuration: generated tokens
per second of wall time and the ratio to the plain run, engine steps, drafted
and accepted tokens (acceptance rate), and whether every request's tokens
equal the plain run's (they must: verification keeps outputs exact).
Each measurement is repeated ``--repeats`` times, interleaved, fastest counts.

Usage::

    python benchmarks/bench_speculative.py [--k 4] [--draft-num-layers 10] [--threads 1] [--repeats 1]
                                       [--max-tokens 64] [--model DIR]
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_generate import run_tpguide

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine
from tpguide.engine.demo_requests import DEMO_REQUESTS


def run_once(engine, max_tokens: int):
    """(token ids per request, wall seconds, engine steps) of one demo run."""
    before = engine.num_steps
    tokens, wall = run_tpguide(engine, DEMO_REQUESTS, max_tokens)
    return tokens, wall, engine.num_steps - before


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model directory; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    p.add_argument("--draft-num-layers", type=int, default=None, help="draft-head layers (default: a third)")
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of demo requests without one")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--repeats", type=int, default=1, help="interleaved repeats, fastest counts (default 1)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    base = dict(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024)
    configs = {
        "plain": EngineConfig(**base, speculative_method=None),
        "grammar": EngineConfig(**base, num_speculative_tokens=args.k),  # the default: forced text only
        "ngram": EngineConfig(**base, speculative_method="ngram", num_speculative_tokens=args.k),
        "draft-head": EngineConfig(**base, speculative_method="draft-head", num_speculative_tokens=args.k,
                                   draft_num_layers=args.draft_num_layers, draft_vocab_size=args.draft_vocab_size),
    }
    engines = {name: build_engine(TPGroup(), args.model, cfg) for name, cfg in configs.items()}
    for engine in engines.values():
        run_once(engine, 4)  # warm-up: grammar compiles, kernels, allocator
    best = {name: (None, float("inf"), 0, None) for name in engines}
    for _ in range(max(1, args.repeats)):
        for name, engine in engines.items():
            engine.reset_speculation_stats()  # count this run only
            tokens, wall, steps = run_once(engine, args.max_tokens)
            if wall < best[name][1]:
                best[name] = (tokens, wall, steps, engine.speculation_stats())
    plain_tokens, plain_wall = best["plain"][0], best["plain"][1]
    total = sum(map(len, plain_tokens))
    layers = engines["draft-head"].draft_head.num_layers
    print(f"\nbuilt-in demo: {len(DEMO_REQUESTS)} requests, {total} generated tokens, K={args.k}, "
          f"draft-head: {layers} layers, draft vocab {args.draft_vocab_size}, threads {args.threads}\n")
    head = (f"{'method':>10} | {'tokens/s':>8} | {'vs plain':>8} | {'steps':>5} | {'drafted':>7} | "
            f"{'accepted':>8} | {'rate':>6} | {'forced':>6} | {'same tokens':>11}")
    print(head)
    print("-" * len(head))
    for name, (tokens, wall, steps, stats) in best.items():
        same = sum(a == b for a, b in zip(tokens, plain_tokens))
        drafted, accepted = (stats.num_drafted, stats.num_accepted) if stats else (0, 0)
        forced = stats.num_forced_drafted if stats else 0
        rate = f"{100 * accepted / drafted:5.1f}%" if drafted else "-"
        print(f"{name:>10} | {sum(map(len, tokens)) / wall:>8.1f} | {plain_wall / wall:>7.2f}x | {steps:>5} | "
              f"{drafted:>7} | {accepted:>8} | {rate:>6} | {forced:>6} | {same:>5}/{len(tokens):<5}")
    print("\n(tokens/s = generated tokens / wall s; vs plain > 1: faster; steps = engine steps incl. prefill;\n"
          " ngram and draft-head draft forced text first (forced = those drafts), the method elsewhere)")
    for engine in engines.values():
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
