"""The exactness table of the GPU acceptance: the same token ids and logprobs however a request is run.

On the fixtures' JSON-schema requests (``--requests``, cycled to ``--rows``)
and on ``launch/generate.py``'s demo, with the engine flags given here
(``launch/generate.py``'s flags and defaults, except ``--max-num-seqs``: the
number of rows, so the reference run is one batch), each request asks for
``logprobs`` and a reference run is compared with:

=============================  ==========================================================
same run twice                 a second fresh engine, same config
CUDA graphs vs eager           ``--no-cuda-graphs`` (on CUDA)
first K of N vs a K-row run    the first ``--sub-rows`` requests alone in their run
each alone vs batched          ``--max-num-seqs 1`` (the first ``--alone`` rows)
grammar drafts vs none         ``--speculative-method none`` (or grammar, if the base is none)
prefix cache on vs off         ``--no-prefix-caching`` (or on, if the base is off)
tp 1 vs tp 2 (NCCL)            ``torchrun --nproc-per-node 2 launch/generate.py``, when two
                               or more GPUs are visible
=============================  ==========================================================

Every run is a fresh engine (its own KV pool, prefix cache, scheduler and
runner); the weights are loaded once and shared (``--reload-model``: once per
engine).  A row that finished with an invalid guided output fails the check
too, and so does a run whose CUDA fast path turned itself off (its first
checked step differed from the plain step, or a capture failed:
tpguide/worker/fast_path_check.py), since its rows then come from the
plain step.  Prints ``set | comparison | identical ids | identical logprobs | s``
and exits 1 on any difference or fallback, 3 when ``--budget-s`` ran out first (the rest
is marked skipped).  See docs/gpu-acceptance.md.

    python benchmarks/gpu_exactness.py [--requests FILE] [--rows 32] [--sub-rows 8] [--alone N]
        [--max-tokens 128] [--no-demo] [--budget-s S] [generate.py's engine flags, e.g. --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import torch

REPO = Path(__file__).resolve().parents[1]

from compare_outputs import compare  # noqa: E402
from engine_runs import (  # noqa: E402
    DEFAULT_FIXTURES,
    FAST_PATH_FALLBACKS,
    demo_request_dicts,
    invalid_outputs,
    json_schema_requests,
    run_engine,
    set_bench_defaults,
    shared_model_loads,
)

from tpguide.cli.engine_flags import add_engine_flags, engine_config_from_args, set_threads  # noqa: E402


@dataclasses.dataclass
class Row:
    """One line of the table; ``same_ids`` None = not run (``note`` says why)."""

    request_set: str
    comparison: str
    n: int
    same_ids: Optional[int] = None
    same_logprobs: Optional[int] = None
    with_logprobs: int = 0
    seconds: float = 0.0
    note: str = ""

    @property
    def identical(self) -> bool:
        return self.same_ids == self.n and self.same_logprobs == self.with_logprobs


def compare_lines(reference: List[dict], other: List[dict]):
    """:func:`compare_outputs.compare` of two lists of output lines: (ids, logprobs, with logprobs, differing)."""
    return compare({o["id"]: o for o in reference}, {o["id"]: o for o in other})


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", default=str(DEFAULT_FIXTURES), help="JSON-lines requests (default: %(default)s)")
    p.add_argument("--rows", type=int, default=32, help="fixture rows of the reference run (default 32)")
    p.add_argument("--sub-rows", type=int, default=8,
                   help="K of 'first K of N' (default 8; N // 2 where N <= K, e.g. the demo's 7 rows)")
    p.add_argument("--alone", type=int, default=None, help="rows run alone (default: all)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every fixture row (default 128)")
    p.add_argument("--logprobs", type=int, default=1, help="logprobs asked on every row (default 1)")
    p.add_argument("--no-demo", dest="demo", action="store_false", help="the fixtures only")
    p.add_argument("--no-fixtures", dest="fixtures", action="store_false", help="the demo only")
    p.add_argument("--tp2", choices=["auto", "never"], default="auto",
                   help="auto: tp 1 vs tp 2 when two or more GPUs are visible (default auto)")
    p.add_argument("--reload-model", action="store_true", help="load the weights for every engine")
    p.add_argument("--budget-s", type=float, default=0.0, help="skip the runs left after S seconds (0: no limit)")
    add_engine_flags(p)
    set_bench_defaults(p)
    return p.parse_args(argv)


ALONE = "each alone vs batched"


def variants(base, rows: int, sub_rows: int, alone: int):
    """``(comparison, config, first rows run)`` of each in-process comparison, cheapest first."""
    drafts = base.speculative_method is not None
    yield "same run twice", base, rows
    if hasattr(base, "cuda_graphs") and torch.cuda.is_available():  # EngineConfig.cuda_graphs, where it exists
        yield ("CUDA graphs vs eager" if base.cuda_graphs else "eager vs CUDA graphs",
               dataclasses.replace(base, cuda_graphs=not base.cuda_graphs), rows)
    if 0 < sub_rows < rows:
        yield f"first {sub_rows} of {rows} vs a {sub_rows}-row run", base, sub_rows
    yield ("grammar drafts vs none" if drafts else "no drafts vs grammar drafts",
           dataclasses.replace(base, speculative_method=None if drafts else "grammar", num_speculative_tokens=None),
           rows)
    yield ("prefix cache on vs off" if base.enable_prefix_caching else "prefix cache off vs on",
           dataclasses.replace(base, enable_prefix_caching=not base.enable_prefix_caching), rows)
    if alone > 0:  # named in check_set: the rows that fit the time left
        yield ALONE, dataclasses.replace(base, max_num_seqs=1), alone


def tp2_flags(args, config) -> List[str]:
    """``launch/generate.py`` flags that give tp 2 the reference run's config."""
    flags = ["--max-num-seqs", str(config.max_num_seqs), "--max-num-batched-tokens", str(config.max_num_batched_tokens),
             "--max-model-len", str(config.max_model_len), "--block-size", str(config.block_size),
             "--dtype", args.dtype, "--guided-backend", config.guided_backend,
             "--json-whitespace", config.json_whitespace, "--seed", str(config.seed),
             "--speculative-method", config.speculative_method or "none", "--quiet"]
    if config.kv_cache_memory is not None:
        flags += ["--kv-cache-memory", str(config.kv_cache_memory)]
    if config.speculative_method is not None:
        flags += ["--num-speculative-tokens", str(config.num_speculative_tokens)]
    if not config.enable_prefix_caching:
        flags.append("--no-prefix-caching")
    if not config.tp_invariant:
        flags.append("--no-tp-invariant")
    if not getattr(config, "cuda_graphs", True):
        flags.append("--no-cuda-graphs")
    return flags + (["--model", args.model] if args.model else [])


def run_tp2(args, config, dicts: List[dict]) -> List[dict]:
    """The requests on ``torchrun --nproc-per-node 2 launch/generate.py``; its output lines."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "requests.jsonl"), os.path.join(tmp, "out.jsonl")
        Path(src).write_text("".join(json.dumps(r) + "\n" for r in dicts))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29531",
               str(REPO / "launch" / "generate.py"), "--requests", src, "--output", out, *tp2_flags(args, config)]
        subprocess.run(cmd, check=True, cwd=REPO)
        return [json.loads(line) for line in Path(out).read_text().splitlines() if line.strip()]


def check_set(name: str, dicts: List[dict], args, base, started: float) -> List[Row]:
    """The reference run of ``dicts`` and every comparison against it."""
    n = len(dicts)
    alone = n if args.alone is None else min(args.alone, n)
    base = dataclasses.replace(base, max_num_seqs=args.max_num_seqs or n)
    table: List[Row] = []

    def time_left() -> float:
        return args.budget_s - (time.perf_counter() - started) if args.budget_s > 0 else float("inf")

    if time_left() <= 0:
        return [Row(name, "reference", n, note=f"skipped: --budget-s {args.budget_s:g} spent")]
    t = time.perf_counter()
    reference, _ = run_engine(args.model, base, dicts, args.max_new_tokens)
    ref_s = time.perf_counter() - t
    print(f"[exactness] {name}: reference run of {n} rows in {ref_s:.1f} s", flush=True)
    bad = invalid_outputs(reference)
    table.append(Row(name, "reference: guided outputs valid", n, n - len(bad), 0, 0, ref_s, "; ".join(bad[:3])))
    jobs = list(variants(base, n, args.sub_rows if args.sub_rows < n else n // 2, alone))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.tp2 == "auto" and gpus >= 2:
        jobs.append(("tp 1 vs tp 2 (NCCL)", None, n))
    for comparison, config, first in jobs:
        # estimates: a run of the reference's rows takes about the reference's time; run alone,
        # each row at most that (its batch's length), so only the rows that fit are run
        if comparison == ALONE:
            if time_left() < first * ref_s:
                first = int(max(time_left(), 0.0) // max(ref_s, 1e-3))
            comparison = f"each of {first} alone vs batched"
        if first < 1 or time_left() < ref_s:
            table.append(Row(name, comparison, first, note=f"skipped: --budget-s {args.budget_s:g} spent"))
            continue
        t = time.perf_counter()
        other = run_tp2(args, base, dicts) if config is None else run_engine(args.model, config, dicts[:first],
                                                                            args.max_new_tokens)[0]
        same_ids, same_lp, with_lp, differing = compare_lines(reference[:first], other)
        bad = invalid_outputs(other)
        note = ", ".join(differing[:4]) + (" ..." if len(differing) > 4 else "")
        if bad:
            note += ("; " if note else "") + f"{len(bad)} invalid: {bad[0]}"
            same_ids -= len(bad)
        table.append(Row(name, comparison, first, same_ids, same_lp, with_lp, time.perf_counter() - t, note))
        print(f"[exactness] {name}: {comparison}: ids {same_ids}/{first}, logprobs {same_lp}/{with_lp} "
              f"({time.perf_counter() - t:.1f} s)", flush=True)
    if args.tp2 == "auto" and gpus < 2:
        table.append(Row(name, "tp 1 vs tp 2 (NCCL)", n, note=f"not run: {gpus} GPU(s) visible"))
    return table


def print_table(table: List[Row]) -> None:
    width = max(len(r.comparison) for r in table)
    head = f"{'set':<8} | {'comparison':<{width}} | {'identical ids':>13} | {'identical logprobs':>18} | {'s':>6}"
    print(head + "\n" + "-" * len(head))
    for r in table:
        if r.same_ids is None:
            print(f"{r.request_set:<8} | {r.comparison:<{width}} | {'-':>13} | {'-':>18} | {'':>6} | {r.note}")
            continue
        lp = f"{r.same_logprobs}/{r.with_logprobs}" if r.with_logprobs else "-"
        mark = "" if r.identical else "  <-- DIFFERS"
        print(f"{r.request_set:<8} | {r.comparison:<{width}} | {f'{r.same_ids}/{r.n}':>13} | {lp:>18} | "
              f"{r.seconds:>6.1f}{mark}" + (f" | {r.note}" if r.note else ""))


def main(argv=None) -> int:
    args = parse_args(argv)
    set_threads(args, 1)
    base = engine_config_from_args(argparse.Namespace(**dict(vars(args), max_num_seqs=args.max_num_seqs or 1)))
    started = time.perf_counter()
    sets = []  # the demo first: the smaller set, so a tight --budget-s still covers both sets' first comparisons
    if args.demo:
        sets.append(("demo", demo_request_dicts(args.max_new_tokens, args.logprobs)))
    if args.fixtures:
        sets.append(("fixtures", json_schema_requests(args.requests, args.rows, args.max_tokens, args.logprobs)))
    table: List[Row] = []
    with shared_model_loads(enabled=not args.reload_model):
        for name, dicts in sets:
            table.extend(check_set(name, dicts, args, base, started))
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(f"\nexactness ({name}, model {args.model or 'embedded'}, dtype {base.dtype}, tp-invariant "
          f"{base.tp_invariant}, speculation {base.speculative_method}, max_tokens {args.max_tokens} (fixtures) / "
          f"{args.max_new_tokens} (demo), {time.perf_counter() - started:.0f} s)")
    print_table(table)
    differs = [r for r in table if r.same_ids is not None and not r.identical]
    skipped = [r for r in table if r.note.startswith("skipped")]
    for line in FAST_PATH_FALLBACKS:  # its rows compared the plain step with itself: not a pass
        print(f"FAST PATH FELL BACK {line}")
    failed = differs or FAST_PATH_FALLBACKS
    print("exactness: " + ("FAILED" if failed else "INCOMPLETE" if skipped else "ok") +
          f" ({len(differs)} comparison(s) differ, {len(FAST_PATH_FALLBACKS)} fast-path fallback(s), "
          f"{len(skipped)} skipped)")
    return 1 if failed else 3 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())
