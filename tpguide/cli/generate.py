"""tpguide's main job: guided generation on N tensor-parallel ranks.

    torchrun --nproc-per-node N launch/generate.py [--model DIR|FILE.gguf]
        [--requests IN.jsonl] [--output OUT.jsonl] [--max-new-tokens N]
    torchrun --nproc-per-node N -m tpguide.generate [...]   # an installed package, no checkout
    tpguide generate [...]                                   # tp 1

Without ``torchrun`` (``python launch/generate.py``) it runs as a single
process, tp_size 1, without ``torch.distributed``.  Without ``--model`` it
uses the embedded SmolLM2-135M-Instruct; a ``.gguf`` file of a supported
architecture is converted once to safetensors in the cache, like the embedded model.
Without ``--requests`` it runs a built-in demo covering every guide type.
Only the driver (rank 0) reads requests and writes outputs.  Each output
line carries its ``request`` and its ``receipt`` (docs/receipts.md), so
``launch/replay.py OUT`` can prove it bit for bit.

``--check-guides`` generates nothing: it admits each request's guide with
the code generation uses and writes one report per request (admitted or
refused, the reasons with JSON Pointers, the keywords enforced / checked
after generation / refused, the backend, the compile time, the guide hash)
to ``--output`` or stdout; exit status 1 when a guide is refused.

Failures: a bad request line fails that request only (``finish_reason``
``"error"``, in its place in the output).  Finished requests are streamed
to ``OUT.partial`` (fsync per line) and ``OUT`` is written atomically at the
end, so a crash loses no finished request and ``--resume`` reruns only the
rest (see :mod:`tpguide.engine.request_io`).  A startup error (bad
``--model``, a tp size the model cannot use, mixed CPU/GPU ranks) or a
failed rank makes every rank print ``[rank R] error: ...`` to stderr and
exit 1; torchrun stops the other workers once one exits non-zero.  A run
whose every request failed exits 1 too, after writing every error record.
``TPGUIDE_FAULT_INJECT=RANK:STEP`` kills a rank on purpose (tests only,
:mod:`tpguide.dist.fault_inject`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from tpguide.cli.engine_flags import add_engine_flags, engine_config_from_args, set_threads
from tpguide.cli.failure_policy import run_main
from tpguide.dist import destroy_tp_group, init_tp_group
from tpguide.dist.fault_inject import FAULT_ENV, step_fault_hook
from tpguide.dist.replica_channel import open_replica_channels
from tpguide.engine import RequestOutput, build_engine
from tpguide.engine.data_parallel import follow_front_end, generate_on_replicas
from tpguide.engine.request_io import (
    load_finished,
    open_partial,
    parse_request_lines,
    read_requests,
    write_outputs,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", help="JSON-lines requests file; default: the built-in demo")
    p.add_argument("--output", help="JSON-lines output file (one line per request, input order)")
    add_engine_flags(p)
    p.add_argument("--resume", action="store_true",
                   help="keep requests already in --output or --output.partial (errors included) "
                        "and run only the others")
    p.add_argument("--retry-errors", action="store_true",
                   help="with --resume: rerun requests whose stored line has finish_reason 'error'")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no per-request report")
    p.add_argument("--check-guides", action="store_true",
                   help="generate nothing: admit each request's guide and report why (docs/receipts.md)")
    return p.parse_args(argv)


def check_guides(args) -> int:
    """``--check-guides``: one JSON report line per request; 1 when some guide is refused."""
    from tpguide.engine.guide_check_offline import check_request_lines, guide_backend
    from tpguide.model.model_source import resolve_model_dir

    backend = guide_backend(str(resolve_model_dir(args.model)), args.guided_backend, args.json_whitespace)
    if args.requests:
        with open(args.requests, encoding="utf-8") as f:
            lines = f.readlines()
    else:
        from tpguide.engine.demo_requests import DEMO_REQUESTS

        lines = [json.dumps(r) for r in DEMO_REQUESTS]
    reports = check_request_lines(lines, backend, args.json_whitespace, args.grammar_compile_timeout)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in reports)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    refused = [r["id"] for r in reports if r.get("guided") is not False and not r.get("admitted")]
    if not args.quiet:
        print(f"{len(reports)} requests: {sum(bool(r.get('admitted')) for r in reports)} guides admitted, "
              f"{len(refused)} refused{' (' + ', '.join(refused[:10]) + ')' if refused else ''}", file=sys.stderr)
    return 1 if refused else 0


def load_requests(args):
    if args.requests:
        return read_requests(args.requests, args.max_new_tokens)
    from tpguide.engine.demo_requests import DEMO_REQUESTS

    return parse_request_lines([json.dumps(r) for r in DEMO_REQUESTS], args.max_new_tokens)


def report(outputs, requests, group, wall_s: float, fresh) -> None:
    """Per request: guide, finish reason, text; then the throughput of the ``fresh`` outputs (this run's)."""
    for out, req in zip(outputs, requests):
        guide = req.structured_output.guide_type if req.structured_output is not None else "none"
        print(f"\n=== {out.id}  [guide: {guide}]  finish: {out.finish_reason}  "
              f"{len(out.token_ids)} tokens, done {out.elapsed_s:.1f} s after the start (batched)")
        if req.messages:
            print(f"  user   : {req.messages[-1]['content']}")
        elif req.prompt is not None:
            print(f"  prompt : {req.prompt[:200]}")
        print(f"  output : {out.text}")
        if out.error:
            print(f"  error  : {out.error}")
    total = sum(len(o.token_ids) for o in fresh)
    kept = f" ({len(outputs) - len(fresh)} more kept from the previous run by --resume)" if len(fresh) < len(outputs) else ""
    print(f"\n{len(fresh)} requests, {total} generated tokens in {wall_s:.1f} s "
          f"({total / max(wall_s, 1e-9):.1f} tok/s) at tp_size={group.tp_size}"
          + (f" x dp_size={group.dp_size}" if group.dp_size > 1 else "") + kept)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.check_guides:  # no engine, no collectives: the tokenizer and the grammar backend, on one process
        return check_guides(args) if os.environ.get("RANK", "0") == "0" else 0
    config = engine_config_from_args(args)
    group = init_tp_group(timeout_s=args.collective_timeout, data_parallel_size=args.data_parallel_size,
                          tensor_parallel_size=args.tensor_parallel_size)
    set_threads(args, group.tp_size)
    channels = (open_replica_channels(group, min(5.0, args.collective_timeout / 4), args.collective_timeout)
                if group.dp_size > 1 else {})  # one replica: no control channels, no split
    engine = build_engine(group, args.model, config)
    if os.environ.get(FAULT_ENV):  # deliberate rank failure for tests (tpguide/dist/fault_inject.py)
        engine.runner.on_step = step_fault_hook(group)
    if not group.is_driver:
        engine.run_worker()  # joins its bitmask thread when the stop plan arrives
        destroy_tp_group(group)  # barrier, then destroy
        return 0
    if group.rank != 0:  # a remote replica's driver: run the share the front end sends
        follow_front_end(engine, channels[0])
        engine.shutdown()
        destroy_tp_group(group)
        return 0
    requests = load_requests(args)
    done = load_finished(args.output, args.retry_errors) if (args.resume and args.output) else {}
    todo = [r for r in requests if r.request_id not in done]
    partial = open_partial(args.output, append=args.resume)
    start = time.perf_counter()
    if channels:
        outs = generate_on_replicas(engine, channels, todo, progress=not args.quiet, on_output=partial)
    else:  # one replica: this engine runs every request
        outs = engine.generate(todo, progress=not args.quiet, on_output=partial)
    fresh = dict(zip((r.index for r in todo), outs))
    wall_s = time.perf_counter() - start
    engine.shutdown()
    outputs = [fresh[r.index] if r.index in fresh else RequestOutput.from_json(done[r.request_id], r.index) for r in requests]
    if args.output:
        write_outputs(args.output, outputs)
        partial.close(remove=True)
    if not args.quiet:
        report(outputs, requests, group, wall_s, list(fresh.values()))
        summary = engine.speculation_summary()
        if summary is not None:
            print(summary)
    destroy_tp_group(group)
    return _status(outputs)


def _status(outputs) -> int:
    """1 (with a line on stderr) when there were requests and every one failed, else 0.

    The output file holds every error record either way; the status tells a
    script that nothing came out (e.g. a JSON request wrapped over several
    lines: each line is a bad request).
    """
    failed = [o for o in outputs if o.finish_reason == "error"]
    if outputs and len(failed) == len(outputs):
        print(f"[rank 0] error: no request succeeded ({len(failed)} of {len(outputs)} failed; the first: "
              f"{failed[0].error})", file=sys.stderr, flush=True)
        return 1
    return 0


def run(argv=None) -> int:
    """:func:`main` with the failure policy (:func:`failure_policy.run_main`)."""
    return run_main(main, argv)


def exit_now(status: int) -> None:
    """Flush stdout and stderr, then leave with ``status`` without interpreter teardown.

    After the job is done (outputs written, process group destroyed in order)
    nothing is left to clean up; teardown could only fail: under load a
    native thread pool (gloo, xgrammar) was seen to abort at exit ("terminate
    called without an active exception", SIGABRT) after every output line had
    been written, turning a finished job into a failed one.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


if __name__ == "__main__":
    exit_now(run())  # python -m tpguide.cli.generate
