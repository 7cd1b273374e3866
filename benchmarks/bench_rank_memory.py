"""Peak RSS of each rank and tokens per second at tp 1 and tp 2, on guided fixture requests (issue 49's measurement).

Each tp size runs the offline job (``launch/generate.py``'s ``main``) in
fresh processes, as a user would: tp 1 as one plain process, tp ``T`` under
``python -m torch.distributed.run --nproc-per-node T``.  Every rank prints
its peak resident set (``getrusage``'s ``ru_maxrss``) when the job is done.
The KV pool is the CLI's default on CPU (``--max-num-seqs`` x
``--max-model-len`` tokens per rank, so the same size per token at every tp
size; its pages count only once written).  Printed per tp size: each rank's
peak RSS, the generated tokens per second of rank 0's report (the requests'
wall time, load excluded), the process wall time, and whether the token ids
equal tp 1's (and a hash of them, to compare runs of two checkouts).

The requests: the first ``--requests`` JSON-schema chat lines of
``vllm_fixtures.jsonl`` that tpguide admits (cycled), ``max_tokens``
``--max-tokens``, greedy.  Make a ~1 B checkpoint first with
``benchmarks/make_random_checkpoint.py``.  ``--tpguide-path`` runs another
checkout's code (e.g. an export of the base commit) with this script.

Usage::

    python benchmarks/bench_rank_memory.py --model /tmp/tpguide-llama-1b [--tp-sizes 1,2] [--requests 8]
        [--max-tokens 32] [--tpguide-path DIR] [--data DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "bench-data"
RSS_TAG = "PEAK_RSS_KIB"
RATE = re.compile(r"(\d+) generated tokens in ([\d.]+) s \(([\d.]+) tok/s\)")


def rank_side(argv: List[str]) -> None:
    """One rank: the offline job with ``argv``, then ``PEAK_RSS_KIB rank kib`` on stderr; never returns."""
    import tpguide  # noqa: F401  (before torch: its init sets libgomp's spin count)
    from tpguide.cli.generate import exit_now, run

    status = run(argv)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(f"{RSS_TAG} {os.environ.get('RANK', '0')} {peak}", file=sys.stderr, flush=True)
    exit_now(status)


def fixture_requests(model: str, data: Path, n: int, max_tokens: int) -> List[dict]:
    """``n`` admitted JSON-schema fixture lines (cycled), ``max_tokens`` each."""
    sys.path.insert(0, str(REPO))
    from benchmarks.bench_vs_vllm import admitted_json_lines, take

    lines = admitted_json_lines(data / "vllm_fixtures.jsonl", model)
    if not lines:
        raise SystemExit(f"no admitted JSON-schema line in {data / 'vllm_fixtures.jsonl'}")
    return take(lines, n, max_tokens, "mem")


def run_tp(tp: int, model: str, requests: Path, out_dir: Path, code_path: str) -> Dict[str, Any]:
    """Run the job at ``tp``; its ranks' peak RSS (bytes), rank 0's tok/s, the wall time and the token ids."""
    output = out_dir / f"out-tp{tp}.jsonl"
    job = [str(Path(__file__).resolve()), "--rank-side", "--model", model, "--requests", str(requests),
           "--output", str(output), "--dtype", "auto"]
    cmd = [sys.executable, *job] if tp == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", *job]
    env = dict(os.environ, PYTHONPATH=code_path)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=out_dir, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"tp {tp} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    peaks = {int(r): int(k) * 1024 for r, k in re.findall(rf"{RSS_TAG} (\d+) (\d+)", proc.stderr)}
    rate = RATE.search(proc.stdout)
    ids = [json.loads(x)["token_ids"] for x in output.read_text().splitlines() if x.strip()]
    return {"tp": tp, "peak_rss": [peaks[r] for r in sorted(peaks)], "tok_s": float(rate.group(3)) if rate else None,
            "tokens": int(rate.group(1)) if rate else None, "wall_s": wall, "token_ids": ids}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF directory (benchmarks/make_random_checkpoint.py makes one)")
    p.add_argument("--tp-sizes", default="1,2", help="comma-separated tp sizes (default 1,2)")
    p.add_argument("--requests", type=int, default=8, help="guided fixture requests, all at once (default 8)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens per request (default 32)")
    p.add_argument("--data", type=Path, default=DATA, help="bench-data folder holding vllm_fixtures.jsonl")
    p.add_argument("--tpguide-path", default=str(REPO), help="PYTHONPATH of the runs (default this checkout)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not (args.data / "vllm_fixtures.jsonl").is_file():
        print(f"no {args.data / 'vllm_fixtures.jsonl'}: nothing to run", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="tpguide-rank-memory-") as tmp:
        requests = Path(tmp) / "requests.jsonl"
        lines = fixture_requests(args.model, args.data, args.requests, args.max_tokens)
        requests.write_text("".join(json.dumps(x) + "\n" for x in lines))
        results = [run_tp(int(t), args.model, requests, Path(tmp), args.tpguide_path)
                   for t in args.tp_sizes.split(",") if t.strip()]
    base = results[0]
    print(f"model {args.model}, {args.requests} guided fixture requests, max_tokens {args.max_tokens}, "
          f"code {args.tpguide_path}")
    print("| tp | peak RSS per rank (MiB) | max rank / tp 1 | tok/s | wall s | token ids = tp 1 | ids sha256 |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        ranks = ", ".join(f"{b / 2**20:.0f}" for b in r["peak_rss"])
        ratio = max(r["peak_rss"]) / max(base["peak_rss"])
        same = sum(a == b for a, b in zip(r["token_ids"], base["token_ids"]))
        digest = hashlib.sha256(json.dumps(r["token_ids"]).encode()).hexdigest()[:12]
        print(f"| {r['tp']} | {ranks} | {ratio:.2f} | {r['tok_s']} | {r['wall_s']:.1f} | "
              f"{same}/{len(base['token_ids'])} | {digest} |")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-side":
        rank_side(sys.argv[2:])
    sys.exit(main())
