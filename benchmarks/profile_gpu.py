"""Where a guided decode step's time goes: device kernels, host work, idle device, and the host syncs in it.

docs/gpu.md "Speed on CUDA: graphs and host syncs".  Builds the engine in
this process at tp 1 (the embedded model, or ``--model DIR``; where the
embedded model is absent, a random-weight checkpoint of its shape with the
tokenizer of ``--tokenizer-dir``), then for each row count of ``--rows``:

1. adds that many guided JSON-schema requests (the JSON-schema lines of
   ``--requests``, default ``../shared/bench-data/vllm_fixtures.jsonl``,
   repeated to fill the rows; built-in ones when the file is absent);
2. runs ``--warmup-steps`` engine steps (prefill, first decode steps);
3. profiles ``--profile-steps`` steps with ``torch.profiler`` (CPU and, on
   CUDA, CUDA activities): per step the wall time, the time the device ran
   kernels (union of kernel and copy intervals), the host's own time (wall
   minus its waits for the device) and the device's idle time; the top
   kernels (CPU: the top host ops);
4. on CUDA, runs one step with ``torch.cuda.set_sync_debug_mode("warn")``
   and records every host-device synchronization with its Python stack
   (the step's one allowed read of the sampled ids lifts the mode, so any
   sync reported is one too many); the last row count then runs one step
   under ``"error"`` mode;
5. aborts the requests.

On CUDA the KV pool's allocation is timed alone (freed, the allocator's
cache emptied, allocated again), then every graph bucket the profiled steps
can use (up to ``max(rows) * (1 + drafts)`` tokens) is captured before the
first row count (timed: what capturing them at start-up would cost).  The
summary lines and the per-step table are printed last.

Usage::

    python benchmarks/profile_gpu.py [--rows 8,32] [--requests FILE] [--model DIR | --tokenizer-dir DIR]
                                     [--warmup-steps 6] [--profile-steps 4] [--max-tokens 128]
                                     [--dtype bfloat16] [--eager] [--no-tp-invariant]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine
from tpguide.engine.request_io import parse_request_lines
from tpguide.model.dtype import DTYPES

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "bench-data" / "vllm_fixtures.jsonl"
#: The embedded SmolLM2-135M's shape, for a random-weight stand-in.
EMBEDDED_SHAPE = dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, intermediate_size=1536, max_position_embeddings=8192,
                      tie_word_embeddings=True, rope_theta=100000.0)
BUILTIN_SCHEMA = {"type": "object", "required": ["name", "age", "city"],
                  "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}
SYNC_CALLS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="8,32", help="row counts (requests at once), comma-separated (default 8,32)")
    p.add_argument("--requests", type=Path, default=FIXTURES, help=f"request lines (default {FIXTURES})")
    p.add_argument("--model", default=None, help="HF directory (default: the embedded model)")
    p.add_argument("--tokenizer-dir", default=None,
                   help="without the embedded model: the tokenizer of the random-weight stand-in")
    p.add_argument("--warmup-steps", type=int, default=6)
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--eager", dest="cuda_graphs", action="store_false",
                   help="profile the eager CUDA path (--no-cuda-graphs) instead of the default CUDA graphs")
    p.add_argument("--no-tp-invariant", dest="tp_invariant", action="store_false")
    return p.parse_args(argv)


def model_dir(args: argparse.Namespace) -> Optional[str]:
    """``--model``, else the embedded model (None), else a random checkpoint of its shape."""
    if args.model is not None:
        return args.model
    try:
        from tpguide.model.default_model import find_default_gguf

        find_default_gguf()
        return None
    except (FileNotFoundError, ModuleNotFoundError, ValueError) as exc:
        if args.tokenizer_dir is None:
            raise SystemExit(f"the embedded model is absent ({exc}); pass --model DIR or --tokenizer-dir DIR "
                             f"for a random-weight checkpoint of its shape") from exc
    from tpguide.model.random_checkpoint import write_random_checkpoint

    out = Path(tempfile.mkdtemp(prefix="tpguide-random-"))
    return str(write_random_checkpoint(out, tokenizer_dir=args.tokenizer_dir, **EMBEDDED_SHAPE))


def request_lines(path: Path, rows: int, max_tokens: int) -> List[str]:
    """``rows`` guided JSON-schema request lines (greedy, ``max_tokens``), the file's repeated in order."""
    base = []
    if path.is_file():
        for line in path.read_text().splitlines():
            obj = json.loads(line) if line.strip() else {}
            if "json" in (obj.get("structured_output") or {}):
                base.append(obj)
    if not base:
        base = [{"id": "builtin", "messages": [{"role": "user", "content": "A person as JSON: name, age, city."}],
                 "structured_output": {"json": BUILTIN_SCHEMA}}]
    out = []
    for i in range(rows):
        r = dict(base[i % len(base)])
        r.update(id=f"{r.get('id', 'r')}#{i}", max_tokens=max_tokens, temperature=0.0)
        out.append(json.dumps(r))
    return out


def busy_us(intervals: List[Tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (microseconds)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def profile_steps(engine, steps: int, on_cuda: bool) -> Tuple[Dict[str, float], str]:
    """Run ``steps`` engine steps under torch.profiler: ``(per-step figures in ms, top table)``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if on_cuda:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    events = prof.events()
    figures = {"wall": wall_ms}
    if on_cuda:
        device = [(e.time_range.start, e.time_range.end) for e in events if e.device_type.name == "CUDA"]
        waits = sum(e.time_range.elapsed_us() for e in events if e.name in SYNC_CALLS)
        figures["kernels"] = busy_us(device) / 1e3 / steps
        figures["host"] = wall_ms - waits / 1e3 / steps
        figures["idle"] = wall_ms - figures["kernels"]
        figures["launches"] = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                   "cudaGraphLaunch")) / steps
        sort = "self_device_time_total"
    else:
        figures["host"] = wall_ms
        sort = "self_cpu_time_total"
    try:
        table = prof.key_averages().table(sort_by=sort, row_limit=15)
    except (AttributeError, KeyError):  # older torch: the cuda_ names
        table = prof.key_averages().table(sort_by=sort.replace("device", "cuda"), row_limit=15)
    return figures, table


def syncs_in_one_step(engine) -> List[str]:
    """The Python stacks of every host sync in one engine step (``set_sync_debug_mode("warn")``)."""
    found: List[str] = []
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            found.append(f"{message}\n" + "".join(traceback.format_stack(limit=14)[:-1]))
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = shown
    return found


def error_mode_step(engine) -> str:
    """One step under ``set_sync_debug_mode("error")``: "" or the first sync's error and stack."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.step()
        return ""
    except RuntimeError as exc:
        return "".join(traceback.format_exception(exc)[-12:])
    finally:
        torch.cuda.set_sync_debug_mode(0)


def run_rows(engine, args, rows: int, last: bool, on_cuda: bool) -> Dict[str, object]:
    requests = parse_request_lines(request_lines(args.requests, rows, args.max_tokens), args.max_tokens)
    for r in requests:
        engine.add_request(r)
    engine.wait_for_admissions()
    for _ in range(args.warmup_steps):
        engine.step()
    figures, table = profile_steps(engine, args.profile_steps, on_cuda)
    report: Dict[str, object] = {"rows": rows, "figures": figures, "table": table, "syncs": [], "error_mode": ""}
    if on_cuda:
        report["syncs"] = syncs_in_one_step(engine)
        if last:
            report["error_mode"] = error_mode_step(engine) or "no sync"
            if report["error_mode"] != "no sync":  # the step raised half-way: the engine is not used again
                return report
    for r in requests:
        engine.abort_request(r.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return report


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    on_cuda = torch.cuda.is_available()
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if on_cuda else torch.float32)
    rows = [int(x) for x in args.rows.split(",")]
    group = TPGroup(device=torch.device("cuda" if on_cuda else "cpu"))
    config = EngineConfig(max_num_seqs=max(rows), dtype=dtype, tp_invariant=args.tp_invariant,
                          cuda_graphs=args.cuda_graphs)
    start = time.perf_counter()
    engine = build_engine(group, model_dir(args), config)
    build_s = time.perf_counter() - start
    kv_s = time_kv_pool_allocation(engine, config) if on_cuda else None
    graphs = engine.runner.graphs
    capture_s = 0.0
    if graphs is not None:  # the buckets these steps can use: rows x (1 + drafts) tokens at most
        start = time.perf_counter()
        graphs.capture_all(up_to=max(rows) * (1 + config.num_speculative_tokens))
        capture_s = time.perf_counter() - start
    reports = [run_rows(engine, args, n, i == len(rows) - 1, on_cuda) for i, n in enumerate(rows)]
    if reports[-1]["error_mode"] in ("", "no sync"):
        engine.shutdown()
    _print(args, on_cuda, dtype, build_s, kv_s, capture_s, graphs, engine.runner, reports)


def time_kv_pool_allocation(engine, config) -> float:
    """Seconds to allocate the engine's KV pool again from an empty cache (cudaMalloc + zeroing).

    Before any graph is captured (graphs hold the pool's addresses) and before any request.
    """
    attn = engine.model.model.layers[0].self_attn.attn
    num_blocks = attn.k_cache.size(0)
    for layer in engine.model.model.layers:
        layer.self_attn.attn.k_cache = layer.self_attn.attn.v_cache = None
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.model.allocate_kv_cache(num_blocks, config.block_size, config.max_model_len)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _print(args, on_cuda, dtype, build_s, kv_s, capture_s, graphs, runner, reports) -> None:
    """The top tables and sync stacks first, then the summary lines and the per-step table (the last lines)."""
    off_reason = runner.graphs_off_reason
    for rep in reports:
        print(f"\n=== {rep['rows']} rows: top {'kernels' if on_cuda else 'host ops'} "
              f"over {args.profile_steps} steps ===\n{rep['table']}")
        if rep["syncs"]:
            print(f"first host sync of one {rep['rows']}-row step (of {len(rep['syncs'])}):\n{rep['syncs'][0]}")
    device = torch.cuda.get_device_name() if on_cuda else "CPU"
    graph_note = (f"{len(graphs.graphs)} buckets captured in {capture_s:.2f} s "
                  f"(largest {max(graphs.capture_seconds.values()):.3f} s)" if graphs is not None and graphs.graphs
                  else f"off ({off_reason or '--eager' if on_cuda else 'CPU'})")
    print(f"\ndevice {device}, torch {torch.__version__}, dtype {dtype}, tp_invariant {args.tp_invariant}, "
          f"engine built in {build_s:.2f} s, CUDA graphs: {graph_note}")
    if kv_s is not None:
        print(f"KV pool allocation alone (empty cache -> zeroed pool): {kv_s:.3f} s")
    checked = ", ".join(f"{kind} {size}: {n}" for (kind, size), n in sorted(runner.fast_path_check.checked.items(),
                                                                          key=str))
    print(f"fast-path steps checked against the plain step (kind bucket: steps): {checked or 'none'}; "
          + (f"FELL BACK: {runner.fast_path_off_reason}" if runner.fast_path_off_reason else "no fallback"))
    for rep in reports:
        if rep["error_mode"]:
            print(f"one {rep['rows']}-row step under set_sync_debug_mode('error'): {rep['error_mode']}")
    head = "| rows | wall ms/step | kernel ms | host ms | device idle ms | kernel share | launches/step | syncs |"
    print("\n" + head + "\n" + "|---" * (head.count("|") - 1) + "|")
    for rep in reports:
        f = rep["figures"]
        if on_cuda:
            print(f"| {rep['rows']} | {f['wall']:.2f} | {f['kernels']:.2f} | {f['host']:.2f} | {f['idle']:.2f} | "
                  f"{f['kernels'] / f['wall']:.0%} | {f['launches']:.0f} | {len(rep['syncs'])} |")
        else:
            print(f"| {rep['rows']} | {f['wall']:.2f} | - | {f['host']:.2f} | - | - | - | - |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
