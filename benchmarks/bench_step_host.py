"""The host side of an engine step: its time outside the forward and the sampling, per row count.

docs/gpu.md "The host side of a step".  On a GPU with CUDA graphs the
forward and the sampling are queued on the device and cost the host little;
what bounds the step rate is the rest of the step on the host: scheduling,
planning, the bitmask fill the step waits for, appending tokens, advancing
the matchers, stop checks and the outputs (detokenized).  That part is the
same code on CPU, so it is measured here, on CPU, with a one-layer random
model that has the embedded model's vocabulary and tokenizer (so the
bitmask, the sampler's rows and the detokenizer are full size, the forward
small).

For each row count of ``--rows`` a fresh engine takes that many guided
JSON-schema requests (the fixtures' ``structured_output.json`` lines,
cycled; greedy, ``--max-tokens``), runs ``--warmup-steps`` steps, then times
``--steps`` steps: the wall time per step, the part in
``StepRunner.execute_model`` (forward), in ``StepRunner.sample_tokens``
(bitmask applied, sampling) and the rest (host).  It prints one line per
row count.  No peer: this measures a share of tpguide's own step.

The bitmask fill (``Driver.fill_bitmask``) runs in a thread while the
forward runs: here the CPU forward hides it, so it is not in the host
figure.  On a GPU the forward is queued and the step waits for the fill, so
the line gives its time alone ("fill": the last timed step's rows filled
again on the main thread, the best of 10).  Then it times
``--steps`` more steps as :meth:`Engine.generate` runs them, building only
the finished requests' outputs ("generate's steps").

Usage::

    python benchmarks/bench_step_host.py [--rows 32,128] [--warmup-steps 60] [--steps 30] [--max-tokens 1024]
                                         [--requests ../shared/bench-data/vllm_fixtures.jsonl]
                                         [--tokenizer-dir DIR] [--drafts] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_gpu import request_lines  # noqa: E402

DEFAULT_REQUESTS = Path(__file__).resolve().parents[2] / "shared" / "bench-data" / "vllm_fixtures.jsonl"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="32,128", help="comma-separated row counts (default 32,128)")
    p.add_argument("--warmup-steps", type=int, default=60)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--requests", type=Path, default=DEFAULT_REQUESTS,
                   help="the bench data's fixtures (built-in requests when absent)")
    p.add_argument("--tokenizer-dir", type=Path, default=None,
                   help="config + tokenizer of the vocabulary (default: the embedded model's)")
    p.add_argument("--drafts", action="store_true", help="grammar drafts on (default off: one token a step)")
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def time_steps(engine, steps: int, finished_only: bool = False):
    """``(wall, forward, sample)`` seconds per step over ``steps`` steps, the last step's outputs and plan.

    ``finished_only``: the steps of :meth:`Engine.generate`, which builds no output for a running request.
    """
    runner, driver = engine.runner, engine.driver
    spent = {"forward": 0.0, "sample": 0.0}
    planned = []
    execute_model, sample_tokens, plan_step = runner.execute_model, runner.sample_tokens, driver.plan_step

    def timed(fn, key):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start
        return call

    def kept(*args):
        planned[:] = [plan_step(*args)]
        return planned[0]

    runner.execute_model, runner.sample_tokens = timed(execute_model, "forward"), timed(sample_tokens, "sample")
    driver.plan_step = kept  # the engine looks it up at each step
    try:
        start = time.perf_counter()
        for _ in range(steps):
            outs = engine.step(finished_only)
        wall = time.perf_counter() - start
    finally:
        runner.execute_model, runner.sample_tokens = execute_model, sample_tokens
        del driver.plan_step
    return wall / steps, spent["forward"] / steps, spent["sample"] / steps, outs, planned[0]


def time_fill(driver, planned, repeats: int = 10) -> float:
    """Seconds of the bitmask fill of ``planned``'s rows (the matchers as they are now), alone: the best of ``repeats``.

    The fill rolls every matcher back (docs/architecture.md §5), so it can be
    repeated.  In a step it runs in a thread beside the forward; on this CPU
    the forward hides it, on a GPU the step waits for it.
    """
    if not planned.plan.guided:
        return 0.0
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        driver.fill_bitmask(planned)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None) -> int:
    args = parse_args(argv)
    from tpguide.dist import TPGroup
    from tpguide.engine import EngineConfig, build_engine
    from tpguide.engine.request_io import parse_request_lines
    from tpguide.model.random_checkpoint import write_random_checkpoint

    torch.set_num_threads(args.threads)
    if args.tokenizer_dir is None:
        from tpguide.model.default_model import default_model_dir

        args.tokenizer_dir = default_model_dir()
    model = write_random_checkpoint(Path(tempfile.mkdtemp()), tokenizer_dir=args.tokenizer_dir, vocab_size=49152,
                                    hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=64)
    lines = []
    for rows in (int(r) for r in args.rows.split(",")):
        extra = {} if args.drafts else {"speculative_method": None}
        engine = build_engine(TPGroup(), str(model), EngineConfig(max_num_seqs=rows, dtype=torch.float32, **extra))
        try:
            for r in parse_request_lines(request_lines(args.requests, rows, args.max_tokens), args.max_tokens):
                engine.add_request(r)
            engine.wait_for_admissions()
            for _ in range(args.warmup_steps):
                engine.step()
            wall, forward, sample, outs, planned = time_steps(engine, args.steps)
            fill = time_fill(engine.driver, planned)
            quiet = time_steps(engine, args.steps, finished_only=True)
        finally:
            engine.shutdown()
        mean_len = sum(len(o.token_ids) for o in outs) / max(1, len(outs))
        lines.append(f"{rows:5d} rows ({len(outs):3d} active, {mean_len:5.0f} tokens each): step {wall * 1e3:6.1f} ms"
                     f" = forward {forward * 1e3:5.1f} + sampling {sample * 1e3:5.1f} + host "
                     f"{(wall - forward - sample) * 1e3:5.1f} ms (generate's steps "
                     f"{(quiet[0] - quiet[1] - quiet[2]) * 1e3:4.1f}); fill {fill * 1e3:4.1f} ms (alone)")
    source = args.requests if args.requests.is_file() else "built-in (no --requests file)"
    print(f"\nhost side of a step (1-layer model, vocabulary 49152, {args.threads} thread(s), "
          f"drafts {'on' if args.drafts else 'off'}, after {args.warmup_steps} steps, mean of {args.steps}; "
          f"requests {source}):")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
