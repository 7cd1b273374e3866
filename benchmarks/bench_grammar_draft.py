"""Grammar drafts: forward passes per generated token and tok/s with and without them, and against transformers.

In one process, at tp 1, on the embedded SmolLM2-135M-Instruct (or
``--model``), per guided backend in ``--backends`` and per batch size in
``--batch-sizes``, greedy:

* **json-schema**: the chat requests of ``benchmarks/bench_generate.py``
  (one JSON schema: name, age, city);
* **jsonschemabench**: the JSONSchemaBench request lines (``--schemas``,
  default ``../shared/bench-data/jsonschemabench_requests.jsonl``, read in
  place, never copied), those the backend admits, cycled to the batch size.

Each batch runs on an engine without drafts (``speculative_method=None``)
and on the default engine (grammar drafts, ``K = --k``); printed: engine
steps of each, forward passes per generated token with drafts (passes whose
sample a request used / generated tokens; 1 without drafts), forced tokens
drafted and accepted, tok/s of each, and whether every request's tokens are
the same (they must be).  **on/free**: the same prompts without their
guides on the default engine, each request forced to the length of its
guided output (``ignore_eos``), so both runs generate the same number of
tokens per request: guided decoding is faster than that when its drafts
save more passes than guidance costs.  On json-schema, transformers ``generate`` with
xgrammar's logits processor (``bench_generate.HFRunner``) runs the same
prompts in the same run, at ``--hf-dtype`` (default: the dtype tpguide's
``--dtype auto`` picks on this CPU, bf16 with AVX512_BF16 or AMX, else
fp32, which is also the peer's fastest).  Forward-pass counts are
deterministic; tok/s are the fastest of ``--repeats`` interleaved runs and
noisy on a shared machine: compare ratios within one run.

Usage::

    python benchmarks/bench_grammar_draft.py [--batch-sizes 1,8,32] [--max-tokens 32] [--k 4]
        [--backends xgrammar,llguidance] [--schemas FILE] [--threads 1] [--repeats 1] [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from bench_generate import HFRunner, request_dicts

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine
from tpguide.engine.request_io import parse_request_lines
from tpguide.model.dtype import resolve_dtype

SCHEMAS = Path(__file__).resolve().parents[2] / "shared" / "bench-data" / "jsonschemabench_requests.jsonl"


def run(engine, dicts: list) -> dict:
    """One ``Engine.generate`` of ``dicts``: token ids, wall s, engine steps, speculative counts, errors."""
    engine.reset_speculation_stats()  # this run only
    steps = engine.num_steps
    requests = parse_request_lines([json.dumps(r) for r in dicts], 32)
    start = time.perf_counter()
    outputs = engine.generate(requests)
    wall = time.perf_counter() - start
    return {"tokens": [o.token_ids for o in outputs], "wall": wall, "steps": engine.num_steps - steps,
            "stats": engine.speculation_stats(),
            "errors": [o.error for o in outputs if o.finish_reason == "error"]}


def admitted_lines(engines: dict, path: Path) -> list:
    """The JSONSchemaBench lines every engine admits (each compiles them once here: the warm-up)."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    keep = set(range(len(lines)))
    for engine in engines.values():
        out = run(engine, [{**r, "id": str(i), "max_tokens": 1} for i, r in enumerate(lines)])
        keep &= {i for i, tokens in enumerate(out["tokens"]) if tokens}
    return [lines[i] for i in sorted(keep)]


def batch_of(workload, n: int, max_tokens: int) -> list:
    """``n`` request dicts of ``workload`` ("json-schema" or a list of JSONSchemaBench lines, cycled)."""
    if workload == "json-schema":
        return request_dicts(n, max_tokens, guided=True)
    return [{**workload[i % len(workload)], "id": f"r{i}", "max_tokens": max_tokens} for i in range(n)]


def unguided_twin(dicts: list, lengths: list) -> list:
    """``dicts`` without their guides, request ``i`` forced to generate exactly ``lengths[i]`` tokens."""
    return [{**{k: v for k, v in r.items() if k != "structured_output"}, "max_tokens": max(1, n),
             "ignore_eos": True} for r, n in zip(dicts, lengths)]


def rate(r: dict) -> float:
    return sum(map(len, r["tokens"])) / r["wall"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model directory; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes (default 1,8,32)")
    p.add_argument("--max-tokens", type=int, default=32, help="max new tokens per request (default 32)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default 4)")
    p.add_argument("--backends", default="xgrammar,llguidance", help="guided backends (default both)")
    p.add_argument("--schemas", default=str(SCHEMAS), help="JSONSchemaBench request lines ('' skips them)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads, both sides (default 1)")
    p.add_argument("--repeats", type=int, default=1, help="interleaved repeats, fastest counts (default 1)")
    p.add_argument("--dtype", default="auto", help="tpguide's dtype (default auto)")
    p.add_argument("--hf-dtype", default=None, help="transformers' dtype (default: what --dtype auto picks)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from tpguide.model.default_model import default_model_dir

    model_dir = str(args.model or default_model_dir())
    sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    dtype = resolve_dtype(args.dtype, "cpu", torch.float32)
    hf_dtype = getattr(torch, args.hf_dtype) if args.hf_dtype else resolve_dtype("auto", "cpu", torch.float32)
    hf = HFRunner(model_dir, hf_dtype)
    hf.run(2, 4)  # warm-up
    schemas = Path(args.schemas) if args.schemas else None
    print(f"\nmodel {model_dir}; tpguide {dtype}, transformers + xgrammar {hf_dtype}; {args.threads} thread(s); "
          f"max_tokens {args.max_tokens}; K {args.k}; greedy; tp 1")
    head = (f"{'backend':>10} | {'workload':>15} | {'batch':>5} | {'steps off/on':>12} | {'passes/token':>12} | "
            f"{'forced drafted/accepted':>23} | {'tok/s off':>9} | {'tok/s on':>8} | {'on/off':>6} | "
            f"{'on/HF':>6} | {'on/free':>8} | {'same':>7}")
    print(head + "\n" + "-" * len(head))
    for backend in [b for b in args.backends.split(",") if b]:
        base = dict(max_num_seqs=max(sizes), max_num_batched_tokens=4096, max_model_len=2048, dtype=dtype,
                    guided_backend=backend)
        engines = {"off": build_engine(TPGroup(), model_dir, EngineConfig(**base, speculative_method=None)),
                   "on": build_engine(TPGroup(), model_dir, EngineConfig(**base, num_speculative_tokens=args.k))}
        workloads = {"json-schema": "json-schema"}
        if schemas is not None and schemas.is_file():
            workloads["jsonschemabench"] = admitted_lines(engines, schemas)
        for engine in engines.values():
            run(engine, batch_of("json-schema", 2, 4))
        for name, workload in workloads.items():
            for n in sizes:
                best: dict = {}
                dicts = batch_of(workload, n, args.max_tokens)
                for _ in range(max(1, args.repeats)):  # interleaved
                    for side, engine in engines.items():
                        r = run(engine, dicts)
                        if side not in best or r["wall"] < best[side]["wall"]:
                            best[side] = r
                    free = run(engines["on"], unguided_twin(dicts, [len(t) for t in best["on"]["tokens"]]))
                    if "free" not in best or free["wall"] < best["free"]["wall"]:
                        best["free"] = free
                    if name == "json-schema":
                        tokens, wall = hf.run(n, args.max_tokens)
                        if "hf" not in best or wall < best["hf"]["wall"]:
                            best["hf"] = {"tokens": tokens, "wall": wall}
                off, on, stats = best["off"], best["on"], best["on"]["stats"]
                same = sum(a == b for a, b in zip(off["tokens"], on["tokens"]))
                vs_hf = f"{rate(on) / rate(best['hf']):.2f}x" if "hf" in best else "-"
                errors = f" ({len(on['errors'])} errors)" if on["errors"] or off["errors"] else ""
                print(f"{backend:>10} | {name:>15} | {n:>5} | {off['steps']:>5}/{on['steps']:<6} | "
                      f"{stats.passes_per_token:>12.3f} | "
                      f"{stats.num_forced_drafted:>11}/{stats.num_forced_accepted:<11} | {rate(off):>9.1f} | "
                      f"{rate(on):>8.1f} | {rate(on) / rate(off):>5.2f}x | {vs_hf:>6} | "
                      f"{rate(on) / rate(best['free']):>7.2f}x | {same:>3}/{n:<3}{errors}")
        for engine in engines.values():
            engine.shutdown()
    print("\n(passes/token: forward passes whose sample a request used / generated tokens, 1.000 without "
          "drafts;\n steps: engine steps (one forward pass each for the whole batch); on/HF: tpguide with "
          "grammar drafts\n over transformers + xgrammar on the same prompts, same run; on/free: over the same prompts "
          "unguided\n on the same engine, each request forced to its guided length; same: requests with "
          "identical tokens off/on)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
