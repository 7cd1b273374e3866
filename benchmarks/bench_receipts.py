"""The cost of receipts (docs/receipts.md): building them against generating, on 32 fixture requests.

On the embedded SmolLM2-135M-Instruct at tp 1, the JSON-schema requests of
``../shared/bench-data/vllm_fixtures.jsonl`` cycled to ``--rows`` (greedy,
``--max-tokens``, with logprobs so that their hash is paid for too), one
engine, after a warm-up run, ``--repeats`` pairs of runs interleaved:

* with receipts (the default): the time spent in the driver's receipt work
  (:func:`~tpguide.engine.receipt.build_receipt` and
  :func:`~tpguide.engine.receipt.request_line`, timed around each call) and
  its share of the run's generation wall time, and the same for the forced-row
  count of every bitmask fill (:func:`~tpguide.guided.bitmask.find_single_token_rows`,
  run whether receipts are on or not, in the fill thread beside the forward);
* without (``driver.receipts = None``): the wall time, for the side-by-side
  difference (noisy on a shared machine; the timed share is the measure).

Then the model fingerprint on the embedded model: cold (every file hashed)
and warm (the cache beside the model).

Usage::

    python benchmarks/bench_receipts.py [--rows 32] [--max-tokens 64] [--repeats 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_runs import DEFAULT_FIXTURES, json_schema_requests  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", default=str(DEFAULT_FIXTURES))
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    from tpguide.dist import TPGroup
    from tpguide.engine import EngineConfig, build_engine
    from tpguide.engine import driver as driver_module
    from tpguide.engine import model_fingerprint as fp
    from tpguide.engine.request_io import parse_request_lines
    from tpguide.model.default_model import default_model_dir

    torch.set_num_threads(args.threads)
    dicts = json_schema_requests(args.requests, args.rows, args.max_tokens, logprobs=1)
    lines = [json.dumps(d) for d in dicts]
    engine = build_engine(TPGroup(), None, EngineConfig(max_num_seqs=args.rows, max_model_len=2048))
    drv, ctx = engine.driver, engine.driver.receipts
    spent = {"receipts": 0.0, "forced": 0.0}

    def timed(fn, key):
        def call(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - start
        return call

    driver_module.build_receipt = timed(driver_module.build_receipt, "receipts")
    driver_module.request_line = timed(driver_module.request_line, "receipts")
    driver_module.find_single_token_rows = timed(driver_module.find_single_token_rows, "forced")
    engine.generate(parse_request_lines(lines, args.max_tokens))  # warm-up: compiles, caches
    rows = []
    for _ in range(args.repeats):
        for with_receipts in (True, False):
            drv.receipts = ctx if with_receipts else None
            spent.update(receipts=0.0, forced=0.0)
            start = time.perf_counter()
            outs = engine.generate(parse_request_lines(lines, args.max_tokens))
            wall = time.perf_counter() - start
            rows.append((with_receipts, wall, dict(spent), sum(len(o.token_ids) for o in outs)))
    engine.shutdown()
    print(f"{args.rows} fixture requests (JSON schema, greedy, max_tokens {args.max_tokens}, logprobs 1), tp 1, "
          f"{args.threads} threads, {torch.__version__}")
    for with_receipts, wall, s, tokens in rows:
        share = (f"receipts {1000 * s['receipts']:.1f} ms = {100 * s['receipts'] / wall:.3f} %" if with_receipts
                 else "no receipts")
        print(f"  generate {wall:.2f} s, {tokens} tokens; {share}; forced-row counts {1000 * s['forced']:.1f} ms = "
              f"{100 * s['forced'] / wall:.3f} %")
    on = min(w for r, w, _, _ in rows if r)
    off = min(w for r, w, _, _ in rows if not r)
    print(f"  fastest with / without receipts: {on:.2f} / {off:.2f} s ({100 * (on / off - 1):+.2f} %, noise included)")
    model_dir = str(default_model_dir())
    real_load = fp._load_cache
    fp._load_cache = lambda path: {}  # cold: hash every file
    start = time.perf_counter()
    fp.model_fingerprint(model_dir)
    cold = time.perf_counter() - start
    fp._load_cache = real_load
    start = time.perf_counter()
    fp.model_fingerprint(model_dir)
    warm = time.perf_counter() - start
    size = sum(f.stat().st_size for f in Path(model_dir).iterdir() if f.is_file())
    print(f"model fingerprint of the embedded model ({size / 2**20:.0f} MiB): cold {cold:.3f} s, "
          f"warm (cached beside the model) {1000 * warm:.2f} ms")


if __name__ == "__main__":
    main()
