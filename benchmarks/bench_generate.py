"""Benchmark guided generation: tpguide against transformers + xgrammar, side by side.

On the embedded SmolLM2-135M-Instruct (or ``--model``), a batch of chat
requests that must answer with a JSON schema (greedy, ``--max-tokens``), per
batch size in ``--batch-sizes``, in one run:

(a) tpguide at tp_size 1, in process (``build_engine`` + ``Engine.generate``);
(b) transformers ``generate`` with xgrammar's HF logits processor (the same
    chat prompts, left padding, greedy, the same ``max_new_tokens`` and stop
    tokens, the same compiled grammar: tpguide's tokenizer info);
(c) tpguide on the same prompts without guidance, each request forced to
    the length of its guided output (``ignore_eos`` + ``max_tokens``), so both
    runs have the same batch in every step and the wall-time difference is
    the cost of guidance alone (grammar matchers, bitmask fill, masking).

Then (d) per rank at tp 1, 2, 4 (``run_on_ranks``, gloo): bytes of the
loaded shard's parameters and buffers, and the peak RSS of the rank process.

Throughput is generated tokens (stop token included) per second of wall time,
after one warm-up run of each; both sides use ``--threads`` intra-op threads.
Each measurement is repeated ``--repeats`` times, the three runs interleaved,
and the fastest run counts (the machine may be shared).
``--profile`` prints tpguide's cProfile (guided, first batch size).

Usage::

    python benchmarks/bench_generate.py [--batch-sizes 8,32] [--max-tokens 32] [--threads 1] [--repeats 2]
                                    [--tp-sizes 1,2,4] [--model DIR] [--profile]
                                    [--modes auto,float32,float32-plain,bfloat16] [--hf-dtypes float32,bfloat16]
                                    [--tp-compare]

``--modes`` adds a table of tpguide weight formats (``-plain`` = without
TP-invariant reductions) against transformers at ``--hf-dtypes``;
``--tp-compare`` adds tp 2 (``--threads`` per rank) against tp 1 (twice
the threads) with collectives per engine step and their time.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import sys
import time
from typing import List, Optional

import hf_xgrammar
import torch

from tpguide.dist import TPGroup
from tpguide.dist.spawn import run_on_ranks
from tpguide.engine import EngineConfig, build_engine
from tpguide.engine.request_io import parse_request_lines

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
}
CITIES = ("Paris", "Lima", "Osaka", "Accra", "Oslo", "Quito", "Perth", "Dakar")
TOPICS = ("a baker", "a pilot", "a student", "a painter", "a nurse", "a farmer", "a chess player", "a poet")


def chat_messages(i: int) -> list:
    topic, city = TOPICS[i % len(TOPICS)], CITIES[(i // len(TOPICS)) % len(CITIES)]
    return [{"role": "user", "content": f"Invent {topic} from {city} (person #{i}). "
                                        f"Reply with JSON: name, age and city."}]


def request_dicts(n: int, max_tokens: int, guided: bool, lengths: Optional[List[int]] = None) -> List[dict]:
    """Chat requests; ``lengths``: unguided, request ``i`` generates exactly ``lengths[i]`` tokens."""
    out = []
    for i in range(n):
        r = {"id": f"r{i}", "messages": chat_messages(i), "max_tokens": max_tokens}
        if guided:
            r["structured_output"] = {"json": SCHEMA}
        if lengths is not None:
            r.update(max_tokens=lengths[i], ignore_eos=True)
        out.append(r)
    return out


# ---------------------------------------------------------------- tpguide
def run_tpguide(engine, dicts: List[dict], default_max_tokens: int = 32):
    """(token ids per request, wall seconds) of one ``Engine.generate`` call; raises if a request failed."""
    requests = parse_request_lines([json.dumps(r) for r in dicts], default_max_tokens)
    start = time.perf_counter()
    outputs = engine.generate(requests)
    wall = time.perf_counter() - start
    bad = [o.error for o in outputs if o.finish_reason == "error"]
    if bad:
        raise RuntimeError(f"tpguide request failed: {bad[0]}")
    return [o.token_ids for o in outputs], wall


class GuidanceTimer:
    """Wall seconds spent in tpguide's guidance code during one run (wraps the methods while active).

    ``critical``: on the step's critical path (scattering the bitmask and
    applying the slice, advancing matchers by sampled tokens; since the
    runner's two phases, the wait in ``Engine.step`` for a fill that outlasts
    the forward is not counted);
    ``overlapped``: filling the bitmask rows, which runs in a thread during
    the forward.  Robust against the machine's noise, unlike a difference of
    two wall times.
    """

    def __init__(self) -> None:
        from tpguide.engine.driver import Driver
        from tpguide.guided.decoder import GuidedDecoder
        from tpguide.worker.runner import StepRunner

        self.targets = [(Driver, "fill_bitmask", "overlapped"), (StepRunner, "_apply_bitmask", "critical"),
                        (GuidedDecoder, "accept_token", "critical")]
        self.seconds = {"critical": 0.0, "overlapped": 0.0}

    def __enter__(self) -> "GuidanceTimer":
        self.saved = [getattr(cls, name) for cls, name, _ in self.targets]
        for (cls, name, kind), fn in zip(self.targets, self.saved):
            setattr(cls, name, self._timed(fn, kind))
        return self

    def _timed(self, fn, kind):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - start
        return timed

    def __exit__(self, *exc) -> None:
        for (cls, name, _), fn in zip(self.targets, self.saved):
            setattr(cls, name, fn)


# ---------------------------------------------------------------- transformers
class HFRunner(hf_xgrammar.HFRunner):
    """:class:`hf_xgrammar.HFRunner` on this benchmark's chat requests (one JSON schema, any whitespace)."""

    def __init__(self, model_dir: str, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(model_dir, dtype)
        self.compiled = self.compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)

    def run(self, n: int, max_tokens: int):
        """(new token ids per row, wall seconds) of ``n`` requests."""
        return self.generate([chat_messages(i) for i in range(n)], [self.compiled] * n, max_tokens)


# ---------------------------------------------------------------- memory
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """Peak RSS of this process: ``getrusage`` and, when there, ``VmHWM`` (the smaller).

    ``ru_maxrss`` survives ``fork`` + ``exec``, so a spawned rank inherits its
    parent's peak; ``VmHWM`` belongs to the address space and starts afresh.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    try:
        with open("/proc/self/status") as f:
            hwm = [int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")]
        return min([peak] + hwm)
    except OSError:
        return peak


def memory_on_rank(group, model_dir: str) -> dict:
    """Load this rank's shard; report its tensor bytes and the process's peak RSS."""
    from tpguide.model.loader import load_model

    before = _rss_bytes()
    model = load_model(model_dir, group, torch.float32)
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:  # tied embeddings count once
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return {"rank": group.tp_rank, "weights": total, "rss_before": before, "peak_rss": _peak_rss_bytes()}


# ---------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model directory; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--batch-sizes", default="8,32", help="comma-separated batch sizes (default 8,32)")
    p.add_argument("--max-tokens", type=int, default=32, help="max new tokens per request (default 32)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both sides (default 1)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats, fastest counts (default 2)")
    p.add_argument("--tp-sizes", default="1,2,4", help="tp sizes of the memory table; '' skips it")
    p.add_argument("--profile", action="store_true", help="cProfile tpguide (guided, first batch size)")
    p.add_argument("--modes", default="",
                   help="also a table of weight formats, e.g. 'auto,float32,float32-plain,bfloat16' for tpguide "
                        "(-plain: --no-tp-invariant) against transformers at --hf-dtypes; '' skips it")
    p.add_argument("--hf-dtypes", default="float32,bfloat16", help="transformers dtypes of the --modes table")
    p.add_argument("--tp-compare", action="store_true",
                   help="also tp 2 (--threads per rank) against tp 1 (2x --threads): tok/s, same tokens, "
                        "collectives per engine step and their time")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError(f"--batch-sizes must list positive ints, got {args.batch_sizes!r}")
    from tpguide.model.default_model import default_model_dir

    model_dir = str(args.model or default_model_dir())
    tp_sizes = [int(t) for t in args.tp_sizes.split(",") if t]
    if tp_sizes:
        mib = 2**20
        print(f"\n{'tp':>3} | {'rank':>4} | {'weights MiB':>11} | {'peak RSS MiB':>12} | {'RSS before load':>15}")
        for tp in tp_sizes:
            for r in run_on_ranks(memory_on_rank, tp, model_dir):
                print(f"{tp:>3} | {r['rank']:>4} | {r['weights'] / mib:>11.1f} | {r['peak_rss'] / mib:>12.1f} | "
                      f"{r['rss_before'] / mib:>15.1f}")
        print("(weights = parameters + buffers of the loaded shard, tied embeddings once; RSS = the whole rank "
              "process, torch included)")

    config = EngineConfig(max_num_seqs=max(batch_sizes), max_num_batched_tokens=4096, max_model_len=512)
    engine = build_engine(TPGroup(), model_dir, config)
    hf = HFRunner(model_dir)
    run_tpguide(engine, request_dicts(2, 4, guided=True))  # warm-up (compiles the schema once)
    run_tpguide(engine, request_dicts(2, 4, guided=False))
    hf.run(2, 4)

    print(f"\nmodel {model_dir}\nthreads {args.threads}, max_tokens {args.max_tokens}, greedy, JSON schema\n")
    head = (f"{'batch':>5} | {'tpguide guided':>14} | {'HF+xgrammar':>11} | {'ratio tp/HF':>11} | "
            f"{'same tokens':>11} | {'tpguide free':>12} | {'guide overhead':>14}")
    print(head)
    print("-" * len(head))
    shares = []
    for n in batch_sizes:
        g_wall = h_wall = f_wall = float("inf")
        for _ in range(max(1, args.repeats)):
            with GuidanceTimer() as timer:
                g_tokens, wall = run_tpguide(engine, request_dicts(n, args.max_tokens, guided=True))
            if wall < g_wall:
                shares.append((n, timer.seconds, wall))
            g_wall = min(g_wall, wall)
            h_tokens, wall = hf.run(n, args.max_tokens)
            h_wall = min(h_wall, wall)
            lengths = [len(t) for t in g_tokens]
            f_tokens, wall = run_tpguide(engine, request_dicts(n, args.max_tokens, False, lengths))
            f_wall = min(f_wall, wall)
            assert [len(t) for t in f_tokens] == lengths, "the unguided run must match the guided lengths"
        g_rate = sum(map(len, g_tokens)) / g_wall
        h_rate = sum(map(len, h_tokens)) / h_wall
        f_rate = sum(map(len, f_tokens)) / f_wall
        same = sum(a == b for a, b in zip(g_tokens, h_tokens))
        print(f"{n:>5} | {g_rate:>10.1f} t/s | {h_rate:>7.1f} t/s | {g_rate / h_rate:>10.2f}x | "
              f"{same:>5}/{n:<5} | {f_rate:>8.1f} t/s | {100 * (f_rate / g_rate - 1):>+13.1f}%")
    print("\n(throughput = generated tokens incl. the stop token / wall s; ratio > 1: tpguide faster;\n"
          " tpguide free = unguided, each request forced to its guided output length;\n"
          " guide overhead = extra wall time of guided over that unguided run, same batch every step:\n"
          " a difference of two noisy wall times)\n")
    for n, sec, wall in {n: (n, sec, wall) for n, sec, wall in shares}.values():
        print(f"batch {n:>3}: guidance code on the critical path {sec['critical']:.3f} s = "
              f"{100 * sec['critical'] / wall:.2f}% of the guided wall time; bitmask fill "
              f"{sec['overlapped']:.3f} s in a thread, overlapped with the forward")

    if args.modes:
        engine.shutdown()
        modes_table(model_dir, batch_sizes, args)
    if args.tp_compare:
        tp_table(model_dir, batch_sizes, args)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        run_tpguide(engine, request_dicts(batch_sizes[0], args.max_tokens, guided=True))
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if not args.modes:
        engine.shutdown()

    return 0


# ---------------------------------------------------------------- weight formats, tp sizes
def _mode_config(mode: str, max_num_seqs: int) -> EngineConfig:
    from tpguide.model.dtype import resolve_dtype

    name, plain = mode.removesuffix("-plain"), mode.endswith("-plain")
    return EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096, max_model_len=512,
                        dtype=resolve_dtype(name, "cpu", torch.float32), tp_invariant=not plain)


def modes_table(model_dir: str, batch_sizes: List[int], args) -> None:
    """tpguide per ``--modes`` against transformers per ``--hf-dtypes``, guided, fastest of ``--repeats``."""
    modes = [m for m in args.modes.split(",") if m]
    hf_dtypes = [d for d in args.hf_dtypes.split(",") if d]
    print(f"\nweight formats (guided, {args.threads} thread(s), max_tokens {args.max_tokens}; "
          f"'auto' is {_mode_config('auto', 1).dtype} on this CPU; int4: not wired into the model, see docs/status.md)")
    runners = {m: build_engine(TPGroup(), model_dir, _mode_config(m, max(batch_sizes))) for m in modes}
    hfs = {d: HFRunner(model_dir, getattr(torch, d)) for d in hf_dtypes}
    for engine in runners.values():
        run_tpguide(engine, request_dicts(2, 4, guided=True))
    for hf in hfs.values():
        hf.run(2, 4)
    for n in batch_sizes:
        best: dict = {}
        for _ in range(max(1, args.repeats)):  # interleaved: every runner once per round
            for name, run in [*((m, lambda e=e: run_tpguide(e, request_dicts(n, args.max_tokens, True)))
                                for m, e in runners.items()),
                              *((f"HF {d}", lambda h=h: h.run(n, args.max_tokens)) for d, h in hfs.items())]:
                tokens, wall = run()
                if name not in best or wall < best[name][1]:
                    best[name] = (tokens, wall)
        base_name = f"HF {hf_dtypes[0]}" if hf_dtypes else None
        ref_tokens = best[modes[0]][0] if modes else None
        for name, (tokens, wall) in best.items():
            rate = sum(map(len, tokens)) / wall
            ratio = f"{rate / (sum(map(len, best[base_name][0])) / best[base_name][1]):.2f}x" if base_name else "-"
            same = sum(a == b for a, b in zip(tokens, ref_tokens)) if ref_tokens is not None else 0
            print(f"batch {n:>3} | {name:>16} | {rate:>7.1f} tok/s | vs {base_name}: {ratio:>6} | "
                  f"same tokens as {modes[0] if modes else '-'}: {same}/{n}")
    for engine in runners.values():
        engine.shutdown()


def tp_job(group, model_dir: str, n: int, max_tokens: int, threads: int) -> Optional[dict]:
    """One rank of the tp comparison: guided run, wall time, engine steps, collectives and their seconds."""
    from tpguide.dist import group as collectives

    torch.set_num_threads(threads)
    stats = {"calls": 0, "seconds": 0.0, "steps": 0}

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                stats["calls"] += 1
                stats["seconds"] += time.perf_counter() - t
        return wrapper

    for name in ("all_reduce", "all_gather_stacked", "broadcast_tensor", "broadcast_object", "scatter_tensor"):
        setattr(collectives, name, timed(getattr(collectives, name)))
    engine = build_engine(group, model_dir, EngineConfig(max_num_seqs=n, max_num_batched_tokens=4096,
                                                         max_model_len=512))
    forward = engine.model.forward

    def counted(*a, **k):
        stats["steps"] += 1
        return forward(*a, **k)
    engine.model.forward = counted
    if not group.is_driver:
        engine.run_worker()
        return None
    run_tpguide(engine, request_dicts(2, 4, guided=True))
    stats.update(calls=0, seconds=0.0, steps=0)
    tokens, wall = run_tpguide(engine, request_dicts(n, max_tokens, guided=True))
    out = dict(stats, tokens=tokens, wall=wall)
    engine.shutdown()
    return out


def tp_table(model_dir: str, batch_sizes: List[int], args) -> None:
    """tp 2 with ``--threads`` per rank against tp 1 with twice that, same requests."""
    print(f"\ntp 2 ({args.threads} thread(s) per rank) vs tp 1 ({2 * args.threads} threads), guided, fp32")
    for n in batch_sizes:
        one = tp_job(TPGroup(), model_dir, n, args.max_tokens, 2 * args.threads)
        two = run_on_ranks(tp_job, 2, model_dir, n, args.max_tokens, args.threads)[0]
        for tp, r in ((1, one), (2, two)):
            rate = sum(map(len, r["tokens"])) / r["wall"]
            print(f"batch {n:>3} | tp {tp} | {rate:>7.1f} tok/s | {r['steps']} steps | "
                  f"{r['calls'] / max(1, r['steps']):.1f} collectives/step | "
                  f"{1e3 * r['seconds'] / max(1, r['steps']):.1f} ms in collectives/step")
        same = sum(a == b for a, b in zip(one["tokens"], two["tokens"]))
        print(f"batch {n:>3} | same tokens tp 1 vs tp 2: {same}/{n}")


if __name__ == "__main__":
    sys.exit(main())
