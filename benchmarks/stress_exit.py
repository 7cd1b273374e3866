"""Exit stress: many ``torchrun --nproc-per-node 2`` jobs on a busy machine must all exit 0.

    python benchmarks/stress_exit.py [--jobs 50] [--nproc 2] [--burners 1]

Writes a tiny random-weight model (SmolLM2's tokenizer) and a few guided and
unguided requests to a temporary folder, starts ``--burners`` CPU-bound
processes beside the jobs (the load under which a rank used to abort at exit),
runs the jobs one after the other and counts their exit codes.
Prints the count and, for a failed job, the tail of its stderr.  Exit status
0 only if every job exited 0 and wrote one output line per request.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REQUESTS = [
    {"id": "free", "prompt": "Once upon a time", "max_tokens": 6},
    {"id": "json", "prompt": "JSON:", "max_tokens": 12,
     "structured_output": {"json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}},
    {"id": "regex", "prompt": "code:", "structured_output": {"regex": "[a-c]{2,4}"}, "max_tokens": 6},
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=50)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--burners", type=int, default=1, help="CPU-bound processes running beside the jobs")
    p.add_argument("--guided-backend", default="xgrammar",
                   help="passed to generate.py (default xgrammar: one backend to build per job, so a job is cheaper "
                        "than with auto)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop the burners
    from tpguide.model.default_model import default_model_dir
    from tpguide.model.random_checkpoint import write_random_checkpoint

    work = tempfile.mkdtemp(prefix="stress-exit-")
    model = str(write_random_checkpoint(os.path.join(work, "tiny"), tokenizer_dir=str(default_model_dir()), seed=1))
    requests = os.path.join(work, "requests.jsonl")
    with open(requests, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in REQUESTS)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    codes = collections.Counter()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        for job in range(args.jobs):
            out = os.path.join(work, f"out-{job}.jsonl")
            cmd = ["torchrun", "--standalone", f"--nproc-per-node={args.nproc}", os.path.join(REPO, "launch", "generate.py"),
                   "--model", model, "--requests", requests, "--output", out, "--quiet",
                   "--guided-backend", args.guided_backend]
            proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
            lines = open(out, encoding="utf-8").read().count("\n") if os.path.exists(out) else 0
            ok = proc.returncode == 0 and lines == len(REQUESTS)
            codes[proc.returncode if lines == len(REQUESTS) else f"{proc.returncode} (missing outputs)"] += 1
            print(f"job {job + 1}/{args.jobs}: exit {proc.returncode}, {lines} output lines", flush=True)
            if not ok:
                print("   stderr tail:\n" + "\n".join("   | " + s for s in proc.stderr.splitlines()[-15:]), flush=True)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    print(f"\nexit codes of {args.jobs} jobs (torchrun --nproc-per-node {args.nproc}, {args.burners} CPU burner(s)): "
          f"{dict(codes)}")
    return 0 if set(codes) == {0} else 1


if __name__ == "__main__":
    sys.exit(main())
