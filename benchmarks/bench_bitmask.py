"""Benchmark ``apply_token_bitmask_inplace`` against xgrammar's kernels, side by side.

Prints one table row per (vocab, rows, mask): tpguide time (``backend="auto"``,
resolved backend named in the header; ``--backend`` forces one), xgrammar time per
backend (CPU: ``cpu``; CUDA: ``triton`` and ``cuda`` when they load), ratio
``xgrammar / tpguide`` (> 1: tpguide is faster) and tpguide's effective
bandwidth (a full read + write of the logits plus the bitmask) against the
``clone`` bandwidth measured in the same run.  Timings are medians of
interleaved repeats.  Masks:

* ``struct``  -- a JSON structural state: 99% of words all zero, rest random;
* ``string``  -- a free string: 95% of words all ones, rest random;
* ``random``  -- uniformly random bits.

Usage::

    python benchmarks/bench_bitmask.py [--device cpu|cuda] [--quick] [--dtype float32] [--threads 1]
                                   [--backend auto] [--vocab 49152] [--rows 1] [--mask string]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tpguide.kernels import BACKENDS, apply_token_bitmask_inplace
from tpguide.kernels.apply_token_bitmask import resolve_backend

VOCABS = (49152, 128256, 151936)
ROWS = (1, 8, 64, 512)
MASKS = ("struct", "string", "random")


def make_bitmask(kind: str, num_rows: int, num_words: int, generator: torch.Generator) -> torch.Tensor:
    """``[num_rows, num_words]`` int32 bitmask of the named kind."""
    shape = (num_rows, num_words)
    random = torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=generator)
    draw = torch.rand(shape, generator=generator)
    if kind == "random":
        return random
    if kind == "struct":
        return torch.where(draw < 0.99, torch.zeros_like(random), random)
    if kind == "string":
        return torch.where(draw < 0.95, torch.full_like(random, -1), random)
    raise ValueError(f"mask kind must be one of {MASKS}, got {kind!r}")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_interleaved(fns: dict, repeats: int, device: str) -> dict:
    """Median seconds per call of each function, calls interleaved to share the noise."""
    times = {name: [] for name in fns}
    for fn in fns.values():  # warm-up (compiles Triton, faults pages in)
        fn()
    _sync(device)
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def clone_bandwidth(device: str, repeats: int) -> float:
    """Bytes per second of ``torch.clone`` (read + write) on a 256 MiB tensor."""
    x = torch.empty(64 * 2**20, dtype=torch.float32, device=device).fill_(1.0)
    out = torch.empty_like(x)
    seconds = time_interleaved({"copy": lambda: out.copy_(x)}, repeats, device)["copy"]
    return 2 * x.numel() * x.element_size() / seconds


def xgrammar_backends(device: str) -> dict:
    """Name -> callable(logits, bitmask) for the xgrammar backends that load here."""
    try:
        import xgrammar
    except ImportError:
        return {}
    names = ("cpu",) if device == "cpu" else ("triton", "cuda")
    found = {}
    for name in names:
        def run(logits, bitmask, name=name):
            xgrammar.apply_token_bitmask_inplace(logits, bitmask, backend=name)
        try:
            probe = torch.zeros(1, 64, device=device)
            run(probe, torch.zeros(1, 2, dtype=torch.int32, device=device))
            found[name] = run
        except Exception as err:  # a backend that fails to build is reported, not fatal
            print(f"# xgrammar backend {name!r} unavailable: {type(err).__name__}: {err}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: xgrammar's CPU kernel is single-threaded)")
    parser.add_argument("--backend", default="auto", choices=BACKENDS, help="tpguide backend")
    parser.add_argument("--vocab", type=int, nargs="*", help="only these vocab sizes")
    parser.add_argument("--rows", type=int, nargs="*", help="only these row counts")
    parser.add_argument("--mask", nargs="*", choices=MASKS, help="only these mask kinds")
    parser.add_argument("--repeats", type=int, help="timed repeats per row (default 11, 5 with --quick)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = args.device, getattr(torch, args.dtype)
    repeats = args.repeats or (5 if args.quick else 11)
    rows_list = args.rows or ((1, 64) if args.quick else ROWS)
    vocabs = args.vocab or ((49152, 151936) if args.quick else VOCABS)
    masks = args.mask or MASKS
    backend = args.backend
    setup_start = time.perf_counter()
    resolved = resolve_backend(backend, device)  # "auto" on CPU compiles the C kernel on first use
    setup_s = time.perf_counter() - setup_start

    bandwidth = clone_bandwidth(device, repeats)
    xgr = xgrammar_backends(device)
    print(f"# device={device} dtype={args.dtype} torch={torch.__version__} threads={torch.get_num_threads()} "
          f"clone bandwidth={bandwidth / 1e9:.1f} GB/s, median of {repeats}")
    print(f"# tpguide backend={backend!r} -> {resolved!r} (resolved in {setup_s * 1e3:.0f} ms, "
          "including a first compile if the kernel cache was empty)")
    head = f"{'vocab':>7} {'rows':>5} {'mask':>7} {'tpguide ms':>11}"
    for name in xgr:
        head += f" {'xgr-' + name + ' ms':>14} {'ratio':>6}"
    print(head + f" {'GB/s':>7} {'%clone':>7}")
    generator = torch.Generator().manual_seed(0)
    worst = float("inf")
    for vocab in vocabs:
        num_words = -(-vocab // 32)
        for num_rows in rows_list:
            logits = torch.randn(num_rows, vocab, generator=generator).to(device, dtype)
            for kind in masks:
                bitmask = make_bitmask(kind, num_rows, num_words, generator).to(device)
                fns = {"tpguide": lambda: apply_token_bitmask_inplace(logits, bitmask, backend=backend)}
                for name, run in xgr.items():
                    fns[name] = lambda run=run: run(logits, bitmask)
                t = time_interleaved(fns, repeats, device)
                line = f"{vocab:>7} {num_rows:>5} {kind:>7} {t['tpguide'] * 1e3:>11.3f}"
                for name in xgr:
                    ratio = t[name] / t["tpguide"]
                    worst = min(worst, ratio)
                    line += f" {t[name] * 1e3:>14.3f} {ratio:>6.2f}"
                moved = 2 * logits.numel() * logits.element_size() + bitmask.numel() * 4
                rate = moved / t["tpguide"]
                print(line + f" {rate / 1e9:>7.1f} {100 * rate / bandwidth:>6.0f}%", flush=True)
    if xgr:
        print(f"# worst ratio xgrammar/tpguide: {worst:.2f}")


if __name__ == "__main__":
    main()
