"""tpguide's main job: guided generation on N tensor-parallel ranks.

    torchrun --nproc-per-node N launch/generate.py [--model DIR]
        [--requests IN.jsonl] [--output OUT.jsonl] [--max-new-tokens N]

Without ``torchrun`` (``python launch/generate.py``) it runs as a single
process, tp_size 1, without ``torch.distributed``.  Without ``--model`` it
uses the embedded SmolLM2-135M-Instruct (converted once to safetensors).
Without ``--requests`` it runs a built-in demo covering every guide type.
Only the driver (rank 0) reads requests and writes outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from tpguide.dist import destroy_tp_group, init_tp_group  # noqa: E402
from tpguide.engine.engine import EngineConfig  # noqa: E402
from tpguide.engine.offline import build_engine  # noqa: E402
from tpguide.engine.request_io import (  # noqa: E402
    load_outputs, parse_request_lines, read_requests, write_outputs)
from tpguide.engine.request import RequestOutput  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local Hugging Face directory (config.json, *.safetensors, tokenizer); "
                                   "default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--requests", help="JSON-lines requests file; default: the built-in demo")
    p.add_argument("--output", help="JSON-lines output file (one line per request, input order)")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="max_tokens of requests that do not set it (default 64)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--guided-backend", choices=["xgrammar", "llguidance"], default="xgrammar")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true",
                   help="keep requests already in --output and run only the others")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no per-request report")
    return p.parse_args(argv)


def load_requests(args):
    if args.requests:
        return read_requests(args.requests, args.max_new_tokens)
    from demo_requests import DEMO_REQUESTS

    return parse_request_lines([json.dumps(r) for r in DEMO_REQUESTS], args.max_new_tokens)


def report(outputs, requests, tp_size: int, wall_s: float) -> None:
    for out, req in zip(outputs, requests):
        guide = req.structured_output.guide_type if req.structured_output is not None else "none"
        rate = len(out.token_ids) / out.elapsed_s if out.elapsed_s > 0 else 0.0
        print(f"\n=== {out.id}  [guide: {guide}]  finish: {out.finish_reason}  "
              f"{len(out.token_ids)} tokens, {rate:.1f} tok/s")
        if req.messages:
            print(f"  user   : {req.messages[-1]['content']}")
        elif req.prompt is not None:
            print(f"  prompt : {req.prompt[:200]}")
        print(f"  output : {out.text}")
        if out.error:
            print(f"  error  : {out.error}")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"\n{len(outputs)} requests, {total} generated tokens in {wall_s:.1f} s "
          f"({total / max(wall_s, 1e-9):.1f} tok/s) at tp_size={tp_size}")


def main(argv=None) -> int:
    args = parse_args(argv)
    group = init_tp_group()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // group.tp_size))
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, guided_backend=args.guided_backend,
                          seed=args.seed, dtype=DTYPES[args.dtype])
    engine = build_engine(group, args.model, config)
    if not group.is_driver:
        engine.run_worker()
        destroy_tp_group(group)
        return 0
    requests = load_requests(args)
    done = load_outputs(args.output) if (args.resume and args.output) else {}
    todo = [r for r in requests if r.request_id not in done]
    start = time.perf_counter()
    fresh = dict(zip((r.index for r in todo), engine.generate(todo, progress=not args.quiet)))
    wall_s = time.perf_counter() - start
    engine.shutdown()
    outputs = [fresh[r.index] if r.index in fresh else RequestOutput(**_output_fields(done[r.request_id]))
               for r in requests]
    if args.output:
        write_outputs(args.output, outputs)
    if not args.quiet:
        report(outputs, requests, group.tp_size, wall_s)
    destroy_tp_group(group)
    return 0


def _output_fields(obj):
    keys = ("id", "text", "token_ids", "finish_reason", "error", "num_prompt_tokens", "logprobs")
    return {k: obj.get(k) for k in keys if k in obj}


if __name__ == "__main__":
    sys.exit(main())
