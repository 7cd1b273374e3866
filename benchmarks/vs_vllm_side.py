"""One side of ``bench_vs_vllm.py`` in a fresh process: tpguide or vLLM runs a job file, timing what a user waits for.

Run by :mod:`benchmarks.bench_vs_vllm` with each system's own interpreter
(vLLM from its own virtual environment, which has no tpguide), so this file
imports nothing of tpguide at module level and nothing of the benchmark.

The job (a JSON file) names the model, dtype, threads and engine limits, and
a list of phases run in order, each a list of request lines in tpguide's
format (docs/usage.md): ``messages``, ``max_tokens``, optional
``structured_output`` (``json``, ``json_object``, ``regex``, ``choice``,
``grammar``), ``ignore_eos``.  Every phase is one offline call with all its
requests submitted at once (greedy).  Printed on the last line, after
``RESULT``: the model load time and, per phase, its wall time (seconds,
grammar compilation included) and each output's text, token count and
finish reason.

Usage::

    python benchmarks/vs_vllm_side.py {tpguide|vllm} JOB.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List


def run_tpguide(job: Dict[str, Any]) -> Dict[str, Any]:
    """Load tpguide at tp 1 and run the phases through ``Engine.generate``."""
    # tpguide before torch, as in the launch scripts: its init sets libgomp's spin count
    from tpguide.dist import TPGroup

    # isort: split
    import torch

    torch.set_num_threads(job["threads"])
    from tpguide.engine import EngineConfig, build_engine
    from tpguide.engine.request_io import parse_request_lines
    from tpguide.model.dtype import resolve_dtype

    start = time.perf_counter()
    config = EngineConfig(max_num_seqs=job["max_num_seqs"], max_num_batched_tokens=job["max_num_batched_tokens"],
                          max_model_len=job["max_model_len"], enable_prefix_caching=job["prefix_caching"],
                          dtype=resolve_dtype(job["dtype"], "cpu", torch.float32))
    engine = build_engine(TPGroup(), job["model"], config)
    result: Dict[str, Any] = {"load_s": time.perf_counter() - start, "dtype": str(config.dtype), "phases": []}
    for phase in job["phases"]:
        requests = parse_request_lines([json.dumps(r) for r in phase], default_max_tokens=64)
        begin = time.perf_counter()
        outs = engine.generate(requests)
        wall = time.perf_counter() - begin
        result["phases"].append({"wall_s": wall, "outputs": [
            {"id": o.request_id, "text": o.text, "num_tokens": len(o.token_ids), "finish_reason": o.finish_reason}
            for o in outs]})
    engine.shutdown()
    return result


def _vllm_params(line: Dict[str, Any]):
    """vLLM ``SamplingParams`` of one request line (greedy; its guide as ``StructuredOutputsParams``)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    guide = line.get("structured_output") or {}
    structured = None
    if guide:
        (kind, value), = guide.items()
        structured = StructuredOutputsParams(**{kind: value})
    return SamplingParams(temperature=0.0, max_tokens=line["max_tokens"], ignore_eos=bool(line.get("ignore_eos")),
                          structured_outputs=structured)


def run_vllm(job: Dict[str, Any]) -> Dict[str, Any]:
    """Load vLLM's CPU build (eager) and run the phases through ``LLM.chat``."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{job['threads'] - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["vllm_dtype"], enforce_eager=True, max_num_seqs=job["max_num_seqs"],
              max_num_batched_tokens=job["max_num_batched_tokens"], max_model_len=job["max_model_len"],
              enable_prefix_caching=job["prefix_caching"], seed=0)
    result: Dict[str, Any] = {"load_s": time.perf_counter() - start, "dtype": job["vllm_dtype"], "phases": []}
    for phase in job["phases"]:
        begin = time.perf_counter()
        outs = llm.chat([r["messages"] for r in phase], [_vllm_params(r) for r in phase], use_tqdm=False)
        wall = time.perf_counter() - begin
        result["phases"].append({"wall_s": wall, "outputs": [
            {"id": r.get("id"), "text": o.outputs[0].text, "num_tokens": len(o.outputs[0].token_ids),
             "finish_reason": o.outputs[0].finish_reason} for r, o in zip(phase, outs)]})
    return result


def main(argv: List[str]) -> int:
    system, path = argv
    with open(path) as f:
        job = json.load(f)
    result = (run_tpguide if system == "tpguide" else run_vllm)(job)
    sys.stdout.flush()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown: native thread pools may abort at exit after the work is done
