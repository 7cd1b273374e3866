"""The server fuzz of the suite, longer: mutated bodies against ``launch/serve.py`` on loopback, figures printed.

    python -m benchmarks.fuzz_server [--count 3000] [--seed 0] [--model DIR] [--tp 1] [--time-limit 1800]

Bodies come from ``tests/fuzz_bodies.py`` (valid chat and completion
requests with one or two mutations: types, numbers, Unicode, schema depth and
typos, tool lists, broken JSON).  One at a time, each followed by
``/health``.  Prints the statuses, the most common 4xx messages, every 5xx
and health failure with its body, requests per second and the server's RSS
at the start and the end.  Bounded in count and time; exits 1 if any 5xx or
failed health check was seen.  It asserts nothing about time.
docs/serving.md, "Faults stay with their request", holds a run's figures.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import httpx

from tests.fuzz_bodies import fuzz_bodies
from tests.server_process import ServerProcess


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (Linux ``/proc``), 0.0 where unreadable."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--time-limit", type=float, default=1800.0, help="stop sending after this many seconds")
    args = p.parse_args(argv)
    flags = ["--served-model-name", "fuzz", "--max-num-seqs", "4", "--max-new-tokens", "12",
             "--max-model-len", "512", "--max-body-bytes", str(1 << 20)]
    if args.model:
        flags += ["--model", args.model]
    statuses: collections.Counter = collections.Counter()
    messages: collections.Counter = collections.Counter()
    bad = []
    with ServerProcess(args.tp, flags) as server:
        rss_start = rss_mib(server.proc.pid)
        start = time.perf_counter()
        sent = 0
        for i, (endpoint, raw, _stream) in enumerate(fuzz_bodies(args.count, "fuzz", args.seed)):
            if time.perf_counter() - start > args.time_limit:
                break
            path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
            r = httpx.post(server.base_url + path, content=raw, headers={"Content-Type": "application/json"},
                           timeout=300)
            sent += 1
            statuses[r.status_code] += 1
            if 400 <= r.status_code < 500:
                messages[r.json()["error"]["message"][:60]] += 1
            elif r.status_code >= 500:
                bad.append(f"body {i}: {r.status_code} {r.text[:300]} <- {raw[:300]!r}")
            health = httpx.get(server.base_url + "/health", timeout=30)
            if health.status_code != 200:
                bad.append(f"after body {i}: /health {health.status_code} {health.text[:300]}")
                break
        wall = time.perf_counter() - start
        rss_end = rss_mib(server.proc.pid)
    print(f"{sent} bodies in {wall:.1f} s ({sent / wall:.1f}/s), seed {args.seed}, tp {args.tp}")
    print("statuses:", dict(sorted(statuses.items())))
    print(f"server RSS: {rss_start:.0f} MiB at the start, {rss_end:.0f} MiB at the end")
    print("most common 4xx messages:")
    for text, n in messages.most_common(12):
        print(f"  {n:5d}  {text}")
    print(f"5xx or failed health checks: {len(bad)}")
    for line in bad[:20]:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
