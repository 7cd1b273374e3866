"""The speed table of the GPU acceptance: tpguide against transformers + xgrammar on the same device.

The fixtures' JSON-schema chat requests (``--requests``, cycled to each of
``--rows``; only the schemas xgrammar compiles, so both sides run the same
rows), greedy, ``--max-tokens``, at ``--dtype`` (default bfloat16):

* tpguide in process, one fresh engine per row count (all rows in one batch,
  the CLI's other defaults: grammar drafts, prefix caching), tp-invariant on
  (exact, the default) and off (``--no-tp-invariant``), weights loaded once per mode;
* transformers ``generate`` with ``xgrammar.contrib.hf.LogitsProcessor``, one
  compiled grammar per row (compiled as tpguide compiles it), left padding;
* each side timed the same way: the wall time of one generate call of all
  rows, after one warm-up of the same rows with other prompts
  (:func:`engine_runs.warm_up_variant`); tok/s = generated tokens (stop
  token included) / that time;
* the time to first token of a fresh process's first guided request:
  ``launch/generate.py`` started with one request (``max_tokens`` 1) until its
  output line is in ``OUT.partial`` (written when the request finishes).

Runs on CPU too (tiny settings, for tests): ``--rows 2 --max-tokens 8``.
See docs/gpu-acceptance.md.

    python benchmarks/bench_gpu.py [--model DIR] [--requests FILE] [--rows 8,32,128] [--max-tokens 128]
        [--dtype bfloat16] [--modes exact,plain] [--no-hf] [--no-ttft]
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
from typing import Dict, List, Optional

import torch
from engine_runs import (
    DEFAULT_FIXTURES,
    FAST_PATH_FALLBACKS,
    json_schema_requests,
    run_engine,
    shared_model_loads,
    warm_up_variant,
)

REPO = Path(__file__).resolve().parents[1]
#: tpguide modes: EngineConfig fields (exact: the defaults, CUDA graphs on; eager: exact with --no-cuda-graphs)
MODES = {"exact": {"tp_invariant": True}, "plain": {"tp_invariant": False},
         "eager": {"tp_invariant": True, "cuda_graphs": False}}


@dataclasses.dataclass
class Timed:
    """Generated tokens and wall seconds of one timed run."""

    tokens: int
    seconds: float
    failed: List[str] = dataclasses.field(default_factory=list)  # "id: error" of rows that ended in an error

    @property
    def rate(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--requests", default=str(DEFAULT_FIXTURES), help="JSON-lines requests (default: %(default)s)")
    p.add_argument("--rows", default="8,32,128", help="comma-separated row counts (default 8,32,128)")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every row (default 128)")
    p.add_argument("--dtype", default="bfloat16", help="both sides' dtype (default bfloat16)")
    p.add_argument("--modes", default="exact,plain", help="tpguide modes: exact (the defaults: tp-invariant, CUDA graphs), plain (--no-tp-invariant), "
                        "eager (exact with --no-cuda-graphs) (default exact,plain)")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="tpguide only")
    p.add_argument("--no-ttft", dest="ttft", action="store_false", help="no fresh-process time to first token")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="skip a run whose estimate (that side's previous run) would end after S s (0: no limit)")
    p.add_argument("--kv-cache-memory", type=int, default=4 * 2**30, help="KV pool bytes per engine (default 4 GiB)")
    return p.parse_args(argv)


def engine_config(args, rows: int, mode: dict):
    """The CLI's defaults but ``max_num_seqs`` = ``rows``, ``--dtype``, the mode and (on CUDA) the KV pool size."""
    from tpguide.engine import EngineConfig

    kv = args.kv_cache_memory if torch.cuda.is_available() else None
    return EngineConfig(max_num_seqs=rows, dtype=getattr(torch, args.dtype), kv_cache_memory=kv, **mode)


def time_tpguide(args, dicts: List[dict], mode: dict) -> Timed:
    """One fresh engine: a warm-up of ``dicts``' shapes, then the timed run (its failed rows listed)."""
    outputs, wall = run_engine(args.model, engine_config(args, len(dicts), mode), dicts,
                               warm_up=warm_up_variant(dicts))
    failed = [f"{o['id']}: {o['error']}" for o in outputs if o["finish_reason"] == "error"]
    return Timed(sum(len(o["token_ids"]) for o in outputs), wall, failed)


def refused_by_tpguide(args, dicts: List[dict], mode: dict) -> Dict[str, str]:
    """``{id: error}`` of the requests tpguide refuses (an error row of a one-token run of each once)."""
    outputs, _ = run_engine(args.model, engine_config(args, len(dicts), mode),
                            [dict(d, max_tokens=1) for d in dicts])
    return {o["id"]: str(o["error"])[:120] for o in outputs if o["finish_reason"] == "error"}


def time_hf(hf, dicts: List[dict], grammars: Dict[str, object], max_tokens: int) -> Timed:
    """A warm-up of ``dicts``' shapes, then the timed ``generate`` of all rows."""
    rows = [grammars[d["id"].split("#")[0]] for d in dicts]
    hf.generate([d["messages"] for d in warm_up_variant(dicts)], rows, max_tokens)
    tokens, wall = hf.generate([d["messages"] for d in dicts], rows, max_tokens)
    return Timed(sum(map(len, tokens)), wall)


def time_to_first_token(args, request: dict, model_dir: str) -> Optional[tuple]:
    """(seconds to the first token, process seconds) of ``launch/generate.py`` with ``request`` alone.

    The request has ``max_tokens`` 1, so it finishes with its first token and
    its line lands in ``OUT.partial`` (fsync per line) before teardown.
    """
    from tpguide.engine.request_io import partial_path

    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "one.jsonl"), os.path.join(tmp, "out.jsonl")
        Path(src).write_text(json.dumps(dict(request, max_tokens=1)) + "\n")
        cmd = [sys.executable, str(REPO / "launch" / "generate.py"), "--model", model_dir, "--requests", src,
               "--output", out, "--dtype", args.dtype, "--quiet"]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO)
        first = None
        while proc.poll() is None and first is None:
            try:
                if Path(partial_path(out)).read_text().strip():
                    first = time.perf_counter() - start
            except FileNotFoundError:
                pass
            time.sleep(0.005)
        proc.wait()
        total = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}")
        return (first if first is not None else total), total


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    from tpguide.model.default_model import default_model_dir

    args.model = str(args.model or default_model_dir())
    row_counts = [int(r) for r in args.rows.split(",") if r]
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not row_counts or min(row_counts) < 1:
        raise ValueError(f"--modes must list {sorted(MODES)} and --rows positive ints, got {args.modes!r}, "
                         f"{args.rows!r}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = grammars = None
    keep = None
    if args.hf:
        from hf_xgrammar import HFRunner

        hf = HFRunner(args.model, getattr(torch, args.dtype), device)
        grammars = {}
        for r in json_schema_requests(args.requests, None, args.max_tokens):
            try:
                grammars[r["id"]] = hf.compile_json(json.dumps(r["structured_output"]["json"]))
            except Exception as exc:  # noqa: BLE001 - reported, the row is left out on both sides
                print(f"[bench_gpu] left out {r['id']}: xgrammar cannot compile it ({type(exc).__name__})")
        keep = sorted(grammars)
    results: Dict[tuple, Timed] = {}
    skipped: List[str] = []
    spent: Dict[str, float] = {}  # each side's last run (warm-up + timed), the estimate of its next

    def fits(side: str) -> bool:
        return args.budget_s <= 0 or time.perf_counter() - started + spent.get(side, 0.0) <= args.budget_s

    ttft = None
    with shared_model_loads():
        refused = refused_by_tpguide(args, json_schema_requests(args.requests, None, 1, keep=keep),
                                     MODES[modes[0] if modes else "exact"])
        for rid, why in refused.items():
            print(f"[bench_gpu] left out {rid}: tpguide refuses it ({why})")
        keep = [r["id"] for r in json_schema_requests(args.requests, None, 1, keep=keep) if r["id"] not in refused]
        if args.ttft:  # before the timed runs: the budget may cut the larger row counts, not this
            first = json_schema_requests(args.requests, 1, args.max_tokens, keep=keep)[0]
            ttft = time_to_first_token(args, first, args.model)
        for n in row_counts:
            dicts = json_schema_requests(args.requests, n, args.max_tokens, keep=keep)
            sides = modes + (["hf"] if hf is not None else [])
            for side in sides:
                if not fits(side):
                    skipped.append(f"{n} rows {side}")
                    continue
                t = time.perf_counter()
                results[(n, side)] = (time_hf(hf, dicts, grammars, args.max_tokens) if side == "hf"
                                      else time_tpguide(args, dicts, MODES[side]))
                spent[side] = time.perf_counter() - t
                print(f"[bench_gpu] {n} rows, {side}: {results[(n, side)].rate:.1f} tok/s", flush=True)
    print_table(args, device, row_counts, modes, results, ttft)
    failed = [f"{n} rows {side}: {len(r.failed)} failed, e.g. {r.failed[0]}" for (n, side), r in results.items()
              if r.failed]
    for line in failed:  # after the admission probe, only an invalid output (the engine's validation) fails a row
        print(f"FAILED ROWS {line}")
    for line in FAST_PATH_FALLBACKS:  # that run's time is the plain eager step's, not the fast path's
        print(f"FAST PATH FELL BACK {line}")
    if skipped:
        print(f"skipped (--budget-s {args.budget_s:g} spent): {', '.join(skipped)}")
    return 1 if failed else 3 if skipped else 0


def print_table(args, device: str, row_counts: List[int], modes: List[str], results: Dict[tuple, Timed],
                ttft: Optional[tuple]) -> None:
    """The speed table: tok/s per side, tpguide over HF per mode, plain over exact; '-' where not run."""
    name = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    print(f"\nspeed ({name}, model {args.model}, {args.dtype}, greedy, max_tokens {args.max_tokens}, "
          f"fixtures' JSON-schema requests; generation wall time after one warm-up)")
    sides = modes + (["hf"] if args.hf else [])
    ratios = [(m, "hf") for m in modes if args.hf] + [(a, b) for a, b in (("plain", "exact"), ("exact", "eager"))
                                                       if {a, b} <= set(modes)]
    titles = [f"tpguide {s}" if s != "hf" else "HF+xgrammar" for s in sides]
    titles += [f"{a}/HF" if b == "hf" else "exact cost" if a == "plain" else f"{a}/{b}" for a, b in ratios]
    head = f"{'rows':>4} | " + " | ".join(f"{t:>20}" if i < len(sides) else f"{t:>10}" for i, t in enumerate(titles))
    print(head + "\n" + "-" * len(head))
    for n in row_counts:
        cells = [f"{results[(n, s)].rate:.1f} tok/s ({results[(n, s)].tokens})" if (n, s) in results else "-"
                 for s in sides]
        cells = [f"{c:>20}" for c in cells]
        for a, b in ratios:
            ok = (n, a) in results and (n, b) in results
            cells.append(f"{results[(n, a)].rate / results[(n, b)].rate:>9.2f}x" if ok else f"{'-':>10}")
        print(f"{n:>4} | " + " | ".join(cells))
    print("(tok/s (generated tokens incl. stop); m/HF > 1: tpguide faster; exact cost = plain tok/s / exact tok/s, "
          "the target is <= 1.35x, docs/gpu.md)")
    if ttft is not None:
        print(f"time to first token, fresh `launch/generate.py` process, one guided request: {ttft[0]:.2f} s "
              f"(process {ttft[1]:.2f} s)")


if __name__ == "__main__":
    sys.exit(main())
