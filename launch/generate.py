"""tpguide's main job: guided generation on N tensor-parallel ranks.

    torchrun --nproc-per-node N launch/generate.py [--model DIR]
        [--requests IN.jsonl] [--output OUT.jsonl] [--max-new-tokens N]

Without ``torchrun`` (``python launch/generate.py``) it runs as a single
process, tp_size 1, without ``torch.distributed``.  Without ``--model`` it
uses the embedded SmolLM2-135M-Instruct (converted once to safetensors).
Without ``--requests`` it runs a built-in demo covering every guide type.
Only the driver (rank 0) reads requests and writes outputs.

Failures: a bad request line fails that request only (``finish_reason``
``"error"``, in its place in the output).  Finished requests are streamed
to ``OUT.partial`` (fsync per line) and ``OUT`` is written atomically at the
end, so a crash loses no finished request and ``--resume`` reruns only the
rest (see :mod:`tpguide.engine.output_stream`).  A startup error (bad
``--model``, a tp size the model cannot use, mixed CPU/GPU ranks) or a
failed rank makes every rank print ``[rank R] error: ...`` to stderr and
exit 1; torchrun stops the other workers once one exits non-zero.
``TPGUIDE_FAULT_INJECT=RANK:STEP`` kills a rank on purpose (tests only,
:mod:`tpguide.dist.fault_inject`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from tpguide.dist import destroy_tp_group, init_tp_group  # noqa: E402
from tpguide.dist.group import DEFAULT_TIMEOUT_S  # noqa: E402
from tpguide.engine.engine import EngineConfig  # noqa: E402
from tpguide.engine.faults import DriverAborted  # noqa: E402
from tpguide.engine.offline import build_engine  # noqa: E402
from tpguide.engine.output_stream import load_finished, open_partial, output_from_json  # noqa: E402
from tpguide.engine.request_io import parse_request_lines, read_requests, write_outputs  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local Hugging Face directory (config.json, *.safetensors, tokenizer); "
                                   "default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--requests", help="JSON-lines requests file; default: the built-in demo")
    p.add_argument("--output", help="JSON-lines output file (one line per request, input order)")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="max_tokens of requests that do not set it (default 64)")
    p.add_argument("--max-num-seqs", type=int, default=16,
                   help="requests running at once: KV-cache slots, bitmask rows (default 16)")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024,
                   help="token budget per step; longer prompts are prefilled in chunks (default 1024)")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="prompt + generated tokens per request (default 2048)")
    p.add_argument("--guided-backend", choices=["auto", "xgrammar", "llguidance"], default="auto",
                   help="grammar engine; auto: per request xgrammar when it enforces every keyword the guide "
                        "uses, else llguidance, else the request is refused (default auto)")
    p.add_argument("--json-whitespace", choices=["compact", "bounded", "any"], default="bounded",
                   help="whitespace between JSON tokens: none, at most 12 characters in a row, or any amount "
                        "(default bounded); a request's structured_output.json_whitespace overrides it")
    p.add_argument("--grammar-compile-timeout", type=float, default=60.0, metavar="S",
                   help="fail a request whose guide takes longer than S seconds to check and compile (compiles "
                        "run in a worker thread while the batch keeps stepping; default 60)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="weights and activations; logits are fp32 (default float32)")
    p.add_argument("--seed", type=int, default=0,
                   help="run seed; a request without 'seed' uses seed * 1000003 + its index (default 0)")
    p.add_argument("--speculative-method", choices=["ngram", "draft-head"], default=None,
                   help="draft tokens verified by the model each decode step (ngram: prompt lookup; "
                        "draft-head: the model's first layers + a pruned vocab-parallel LM head); "
                        "output tokens are the same as without it")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="most drafts per request per step, 1..16 (default 4 with --speculative-method)")
    p.add_argument("--draft-num-layers", type=int, default=None,
                   help="draft-head: target layers the drafter runs (default: a third, rounded up)")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="draft-head: token ids the draft LM head predicts, the first ids + the stop tokens "
                        "(default 8192)")
    p.add_argument("--no-draft-lens", dest="draft_lens", action="store_false",
                   help="draft-head: no tuned-lens translator after the drafter's last layer (by default one "
                        "is fitted on built-in calibration text at the first start, about 15 s for the "
                        "embedded model on 2 CPU cores, and cached)")
    p.add_argument("--resume", action="store_true",
                   help="keep requests already in --output or --output.partial (errors included) "
                        "and run only the others")
    p.add_argument("--retry-errors", action="store_true",
                   help="with --resume: rerun requests whose stored line has finish_reason 'error'")
    p.add_argument("--collective-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds a rank waits in a collective before failing (default {DEFAULT_TIMEOUT_S:g}); "
                        "a dead rank is noticed sooner (closed sockets, torchrun's agent)")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no per-request report")
    return p.parse_args(argv)


def load_requests(args):
    if args.requests:
        return read_requests(args.requests, args.max_new_tokens)
    from demo_requests import DEMO_REQUESTS

    return parse_request_lines([json.dumps(r) for r in DEMO_REQUESTS], args.max_new_tokens)


def report(outputs, requests, tp_size: int, wall_s: float, fresh) -> None:
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
          f"({total / max(wall_s, 1e-9):.1f} tok/s) at tp_size={tp_size}{kept}")


def main(argv=None) -> int:
    args = parse_args(argv)
    _check_draft_flags(args)
    if args.collective_timeout <= 0:
        raise ValueError(f"--collective-timeout must be > 0, got {args.collective_timeout}")
    group = init_tp_group(timeout_s=args.collective_timeout)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // group.tp_size))
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, guided_backend=args.guided_backend,
                          json_whitespace=args.json_whitespace, grammar_compile_timeout_s=args.grammar_compile_timeout,
                          seed=args.seed, dtype=DTYPES[args.dtype],
                          speculative_method=args.speculative_method,
                          num_speculative_tokens=_num_speculative_tokens(args),
                          draft_num_layers=args.draft_num_layers, draft_vocab_size=args.draft_vocab_size or EngineConfig.draft_vocab_size,
                          draft_lens=args.draft_lens)
    engine = build_engine(group, args.model, config)
    if not group.is_driver:
        engine.run_worker()  # joins its bitmask thread when the stop plan arrives
        destroy_tp_group(group)  # barrier, then destroy
        return 0
    requests = load_requests(args)
    done = load_finished(args.output, args.retry_errors) if (args.resume and args.output) else {}
    todo = [r for r in requests if r.request_id not in done]
    partial = open_partial(args.output, append=args.resume)
    start = time.perf_counter()
    fresh = dict(zip((r.index for r in todo), engine.generate(todo, progress=not args.quiet, on_output=partial)))
    wall_s = time.perf_counter() - start
    engine.shutdown()
    outputs = [fresh[r.index] if r.index in fresh else output_from_json(done[r.request_id]) for r in requests]
    if args.output:
        write_outputs(args.output, outputs)
        partial.close(remove=True)
    if not args.quiet:
        report(outputs, requests, group.tp_size, wall_s, list(fresh.values()))
        if engine.driver.spec is not None:
            spec = engine.driver.spec
            print(spec.stats.summary(spec.method, spec.num_speculative_tokens))
    destroy_tp_group(group)
    return 0


def _check_draft_flags(args) -> None:
    """The draft-head flags need ``--speculative-method draft-head`` (else they would be silently ignored)."""
    used = [flag for flag, on in (("--draft-num-layers", args.draft_num_layers is not None),
                                  ("--draft-vocab-size", args.draft_vocab_size is not None),
                                  ("--no-draft-lens", not args.draft_lens)) if on]
    if used and args.speculative_method != "draft-head":
        raise ValueError(f"{', '.join(used)} {'needs' if len(used) == 1 else 'need'} --speculative-method "
                         f"draft-head, got --speculative-method {args.speculative_method}")


def _num_speculative_tokens(args) -> int:
    if args.num_speculative_tokens is not None:
        return args.num_speculative_tokens
    return 4 if args.speculative_method else 0


def _in_collective(exc: BaseException) -> bool:
    """True if ``exc`` was raised inside a ``torch.distributed`` collective (a peer died, a timeout)."""
    if isinstance(exc, torch.distributed.DistError):
        return True
    return any("torch/distributed/" in frame.filename.replace(os.sep, "/")
               for frame in traceback.extract_tb(exc.__traceback__))


def run(argv=None) -> int:
    """:func:`main` with the failure policy: ``[rank R] error: ...`` on stderr, exit status 1.

    Bad input and startup errors (``ValueError``, ``FileNotFoundError``), a
    driver abort and a failed collective print one line; anything else
    prints its traceback first.  ``os._exit`` skips interpreter teardown,
    which could block on a process group whose peers are gone.
    """
    rank = os.environ.get("RANK", "0")
    try:
        return main(argv)
    except (ValueError, FileNotFoundError, DriverAborted) as exc:
        print(f"[rank {rank}] error: {exc}", file=sys.stderr, flush=True)
    except Exception as exc:  # noqa: BLE001 - every failure exits 1
        if _in_collective(exc):
            first = (str(exc).strip().splitlines() or [""])[0]
            print(f"[rank {rank}] error: a collective failed: another rank died or timed out "
                  f"(torchrun's summary names the first failed rank): {type(exc).__name__}: {first}",
                  file=sys.stderr, flush=True)
        else:  # a bug: show where
            traceback.print_exc()
            print(f"[rank {rank}] error: unexpected {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


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
    exit_now(run())
