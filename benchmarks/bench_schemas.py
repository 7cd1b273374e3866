"""JSONSchemaBench through ``launch/generate.py``: coverage per backend, invalid "stop" outputs, "length" finishes.

    python benchmarks/bench_schemas.py --requests REQUESTS.jsonl
        [--runs xgrammar:bounded,llguidance:bounded,auto:bounded,auto:any] [--model DIR] [--out-dir DIR]

Each run is ``launch/generate.py --guided-backend B --json-whitespace W`` on
the request file (tp 1, the embedded model unless ``--model``).  Per run it
prints:

* **admitted**: requests not refused at admission (compile coverage: the
  backend compiled the schema and enforces every keyword it uses);
* **stop / length / error** finishes, and errors after admission;
* **invalid stop**: "stop" outputs that fail ``jsonschema`` here, checked
  independently of the engine (must be 0);
* the reasons of refusals, grouped.

The data set (60 real-world schemas, six from each of JSONSchemaBench's ten
categories, as request lines) is not part of the repository: pass its path
with ``--requests``.
Counts only; no timings.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_generate(requests: str, out: str, backend: str, whitespace: str, model: str | None) -> None:
    cmd = [sys.executable, os.path.join(REPO, "launch", "generate.py"), "--requests", requests, "--output", out,
           "--guided-backend", backend, "--json-whitespace", whitespace, "--quiet"]
    if model:
        cmd += ["--model", model]
    subprocess.run(cmd, check=True, cwd=REPO)


def _reason(error: str) -> str:
    """A refusal message without request-specific details, for grouping."""
    text = re.sub(r"\(at [^)]*\)", "", error)
    text = re.sub(r"'[^']*'", lambda m: m.group(0) if re.fullmatch(r"'[A-Za-z$][\w$ ()-]{0,40}'", m.group(0))
                  else "'…'", text)  # keeps keyword names
    text = re.sub(r"\s+", " ", text)
    clauses = list(dict.fromkeys(c.strip() for c in text.split(";")))  # each distinct cause once
    text = " ; ".join(clauses)
    return text[:160]


def summarise(requests: list, outputs: list) -> dict:
    """Counts for one run (see the module docstring)."""
    from tpguide.guided.schema_check import validator_for_schema

    schemas = {r["id"]: r["structured_output"]["json"] for r in requests}
    counts = collections.Counter()
    refusals = collections.Counter()
    invalid = []
    for out in outputs:
        reason = out["finish_reason"]
        refused = reason == "error" and not out["token_ids"]
        counts["refused" if refused else "admitted"] += 1
        counts[reason] += 1
        if refused:
            refusals[_reason(out["error"] or "")] += 1
        elif reason == "error":
            counts["error after admission"] += 1
        if reason == "stop":
            try:
                ok = validator_for_schema(schemas[out["id"]]).is_valid(json.loads(out["text"]))
            except ValueError:
                ok = False
            if not ok:
                invalid.append(out["id"])
        backend = out.get("guided_backend")
        if backend and not refused:
            counts[f"ran on {backend}"] += 1
    counts["invalid stop"] = len(invalid)
    return {"counts": counts, "refusals": refusals, "invalid": invalid}


def admission_only(requests: list, backends: list) -> int:
    """Print, per backend, how many schemas admission accepts (the embedded model's tokenizer)."""
    from transformers import AutoTokenizer

    from tpguide.engine.request_io import request_from_dict
    from tpguide.guided import make_backend
    from tpguide.guided.admission import admit
    from tpguide.model.default_model import default_model_dir
    from tpguide.model.tokenizer_facts import collect_stop_token_ids

    model_dir = str(default_model_dir())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stops = collect_stop_token_ids(tokenizer, model_dir)
    size = -(-len(tokenizer) // 64) * 64
    for name in backends:
        backend, counts = make_backend(name, tokenizer, size, stops), collections.Counter()
        reasons = collections.Counter()
        for i, r in enumerate(requests):
            req = request_from_dict(r, i, 64)
            try:
                if req.is_finished:  # refused while parsing the request (e.g. an invalid schema)
                    raise ValueError(req.error)
                counts["admitted on " + admit(backend, req.structured_output)[0]] += 1
            except ValueError as exc:
                counts["refused"] += 1
                reasons[_reason(str(exc))] += 1
        print(f"{name}: {dict(sorted(counts.items()))} of {len(requests)}")
        for reason, n in reasons.most_common():
            print(f"  {n:3d}  {reason}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", required=True, help="JSONSchemaBench request lines")
    p.add_argument("--runs", default="xgrammar:bounded,llguidance:bounded,auto:bounded,auto:any",
                   help="comma-separated BACKEND:WHITESPACE pairs")
    p.add_argument("--model", default=None)
    p.add_argument("--out-dir", default=None, help="keep the output files here (default: a temporary folder)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="cap every request's max_tokens (the file asks 256; a smaller cap makes a run on a slow "
                        "CPU feasible, and 'length' then counts requests cut at the cap)")
    p.add_argument("--admission-only", action="store_true",
                   help="only admit each schema on each backend (checks + compile, no generation): coverage")
    args = p.parse_args(argv)
    if not os.path.isfile(args.requests):
        print(f"no request file at {args.requests}", file=sys.stderr)
        return 1
    with open(args.requests, encoding="utf-8") as f:
        requests = [json.loads(line) for line in f if line.strip()]
    if args.admission_only:
        return admission_only(requests, sorted({spec.split(":")[0] for spec in args.runs.split(",")}))
    out_dir = args.out_dir or tempfile.mkdtemp(prefix="bench-schemas-")
    os.makedirs(out_dir, exist_ok=True)
    if args.max_tokens is not None:
        for r in requests:
            r["max_tokens"] = min(r.get("max_tokens", args.max_tokens), args.max_tokens)
        args.requests = os.path.join(out_dir, f"requests-max{args.max_tokens}.jsonl")
        with open(args.requests, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in requests)
    rows = []
    for spec in args.runs.split(","):
        backend, whitespace = spec.split(":")
        out = os.path.join(out_dir, f"{backend}-{whitespace}.jsonl")
        if not os.path.isfile(out):
            run_generate(args.requests, out, backend, whitespace, args.model)
        with open(out, encoding="utf-8") as f:
            outputs = [json.loads(line) for line in f if line.strip()]
        summary = summarise(requests, outputs)
        rows.append((spec, summary))
        c = summary["counts"]
        ran = ", ".join(f"{k[7:]} {v}" for k, v in sorted(c.items()) if k.startswith("ran on "))
        print(f"\n== {spec}: {len(outputs)} requests, admitted {c['admitted']} ({ran}), refused {c['refused']}; "
              f"stop {c['stop']}, length {c['length']}, error {c['error']} "
              f"({c['error after admission']} after admission); invalid stop {c['invalid stop']} "
              f"{summary['invalid']}")
        for reason, n in summary["refusals"].most_common(8):
            print(f"   {n:3d} x {reason}")
    print("\n| run | admitted | stop | length | error after admission | invalid stop |")
    print("|---|---|---|---|---|---|")
    for spec, summary in rows:
        c = summary["counts"]
        print(f"| {spec} | {c['admitted']}/{sum(c[k] for k in ('admitted', 'refused'))} | {c['stop']} | "
              f"{c['length']} | {c['error after admission']} | {c['invalid stop']} |")
    print(f"\noutputs in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
