"""What TP-invariant reductions cost: model decode steps, invariant vs plain all-reduce, one run.

On the embedded SmolLM2-135M-Instruct (or ``--model``): ``--batch`` sequences
prefilled with ``--prompt-len`` tokens, then ``--steps`` decode steps (model
forward + LM-head logits of every row), timed per step.  Both variants are
loaded side by side and their repeats interleaved, so a shared machine slows
both alike; the ratio is the result, the milliseconds are this run's only.

Per tp size (tp 1 in process, tp > 1 on gloo ranks via ``run_on_ranks``,
``--threads`` intra-op threads per rank): ms per decode step, invariant /
plain, and the collectives per step with the wall time spent inside them.

Usage::

    python benchmarks/bench_tp_invariance.py [--tp-sizes 1,2] [--threads 1] [--batch 8] [--steps 16]
                                         [--repeats 3] [--dtype float32] [--model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from tpguide.dist import TPGroup
from tpguide.dist import group as collectives
from tpguide.dist.spawn import run_on_ranks
from tpguide.model.attention import AttentionMetadata
from tpguide.model.dtype import DTYPES
from tpguide.model.loader import load_model


class CollectiveTimer:
    """Counts the calls into the collectives of :mod:`tpguide.dist.group` and the seconds spent in them (patched in place)."""

    NAMES = ("all_reduce", "all_gather_stacked", "broadcast_tensor", "broadcast_object")

    def __init__(self) -> None:
        self.calls, self.seconds = 0, 0.0
        for name in self.NAMES:
            setattr(collectives, name, self._timed(getattr(collectives, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls += 1
                self.seconds += time.perf_counter() - t
        return timed


def _decode_steps(model, batch: int, prompt_len: int, steps: int, timer: CollectiveTimer) -> list:
    """Prefill, then ``steps`` decode steps; returns ``(seconds, collective calls, collective seconds)`` per step."""
    vocab = model.config.org_vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch * prompt_len,), generator=gen)
    meta = AttentionMetadata.from_lists(list(range(batch)), [prompt_len] * batch, [0] * batch)
    model(ids, meta.token_positions, meta)
    out = []
    for s in range(steps):
        meta = AttentionMetadata.from_lists(list(range(batch)), [1] * batch, [prompt_len + s] * batch)
        ids = torch.randint(0, vocab, (batch,), generator=gen)
        calls, secs, t = timer.calls, timer.seconds, time.perf_counter()
        model.compute_logits(model(ids, meta.token_positions, meta))
        out.append((time.perf_counter() - t, timer.calls - calls, timer.seconds - secs))
    return out


def bench_on_rank(group: TPGroup, model_dir: str, dtype_name: str, threads: int, batch: int, prompt_len: int,
                  steps: int, repeats: int) -> dict:
    """Median ms per decode step (and collectives) for ``plain`` and ``invariant``, repeats interleaved."""
    torch.set_num_threads(threads)
    timer = CollectiveTimer()
    models = {name: load_model(model_dir, group, DTYPES[dtype_name], tp_invariant=name == "invariant")
              for name in ("plain", "invariant")}
    for m in models.values():
        m.allocate_kv_cache(batch, prompt_len + steps + 1)
    samples: dict = {name: [] for name in models}
    for rep in range(repeats + 1):  # the first round warms up
        for name, m in models.items():
            result = _decode_steps(m, batch, prompt_len, steps, timer)
            if rep:
                samples[name] += result
    return {name: {"ms_per_step": 1e3 * statistics.median(s for s, _, _ in v),
                   "collectives_per_step": statistics.median(c for _, c, _ in v),
                   "collective_ms_per_step": 1e3 * statistics.median(t for _, _, t in v)}
            for name, v in samples.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model directory; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--tp-sizes", default="1,2", help="comma-separated tp sizes (default 1,2)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (default 1)")
    p.add_argument("--batch", type=int, default=8, help="sequences decoded per step (default 8)")
    p.add_argument("--prompt-len", type=int, default=64, help="prefilled tokens per sequence (default 64)")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per repeat (default 16)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats after one warm-up (default 3)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = p.parse_args(argv)
    if args.model is None:
        from tpguide.model.default_model import default_model_dir

        args.model = str(default_model_dir())
    job = (args.model, args.dtype, args.threads, args.batch, args.prompt_len, args.steps, args.repeats)
    print(f"decode steps, batch {args.batch}, {args.dtype}, {args.threads} thread(s) per rank; "
          "ms are this run's (shared machine), compare the ratio")
    print(f"{'tp':>3} {'plain ms':>9} {'invariant ms':>13} {'ratio':>6} {'collectives':>12} "
          f"{'coll ms plain':>14} {'coll ms inv':>12}")
    for tp in [int(t) for t in args.tp_sizes.split(",") if t]:
        res = bench_on_rank(TPGroup(), *job) if tp == 1 else run_on_ranks(bench_on_rank, tp, *job)[0]
        plain, inv = res["plain"], res["invariant"]
        print(f"{tp:>3} {plain['ms_per_step']:>9.1f} {inv['ms_per_step']:>13.1f} "
              f"{inv['ms_per_step'] / plain['ms_per_step']:>6.3f} {inv['collectives_per_step']:>12.0f} "
              f"{plain['collective_ms_per_step']:>14.1f} {inv['collective_ms_per_step']:>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
