"""Benchmark the server against the offline path on the same guided requests, in one run.

(a) the offline path of ``launch/generate.py`` (``Engine.generate`` on the
    request lines, the same tp size and engine flags, ranks spawned with
    gloo): generated tokens per second of generation wall time, after a
    warm-up batch of the same guide kinds, as the server gets (so neither
    side pays for building the grammar backend or compiling the guides);
(b) ``launch/serve.py`` as a subprocess on a free loopback port, driven by
    ``--clients`` concurrent asyncio streaming clients (httpx, SSE) that
    share the same requests: requests/s, output tok/s, time to first token
    and inter-token latency (p50 / p99), errors, and invalid outputs (a
    ``stop`` output that does not satisfy its guide).

The machine may be shared, so only the ratio server / offline measured in
the same run means something; ``--rounds R`` alternates the two phases R
times (the server stays up, idle, while generate.py runs) and keeps the
fastest round of each.  Bounded in count (``--requests``) and time
(``--time-limit``); loopback only.  Run it from the repository root with
``python -m``: it starts the server with the test suite's
``tests/server_process.py``.

``--dp D`` instead compares two servers measured in the same run, both
with one thread per rank: D replicas of tp ``--tp`` (``torchrun
--nproc-per-node D*tp launch/serve.py --data-parallel-size D``) against one
(docs/architecture.md §1 "Data parallel"), alternating ``--rounds`` times.

Usage::

    python -m benchmarks.bench_serve [--clients 16] [--requests 64] [--max-tokens 32] [--tp 1]
                                     [--time-limit 600] [--rounds 1] [--model DIR] [--dp D]
    python -m benchmarks.bench_serve --shared-prefix [--clients 16] [--turns 8] [--max-tokens 32]
                                     (prefix caching on vs off, benchmarks/shared_prefix.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from typing import Any, Dict, List

import httpx
import jsonschema

from tests.server_process import ServerProcess

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[0-9]{1,3}(\.[0-9]{1,2})?"
CHOICES = ["yes", "no", "maybe"]
TOPICS = ("a baker", "a pilot", "a student", "a painter", "a nurse", "a farmer", "a chess player", "a poet")


def make_requests(n: int, max_tokens: int) -> List[Dict[str, Any]]:
    """``n`` request lines cycling over four guide kinds (seeded sampling, so both paths agree)."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        kind = ("json", "regex", "choice", "json_object")[i % 4]
        guide, ask = {
            "json": ({"json": SCHEMA}, f"Invent {topic}; JSON with name and age."),
            "regex": ({"regex": REGEX}, f"How tall in metres is {topic}? A number only."),
            "choice": ({"choice": CHOICES}, f"Is {topic} happy? yes, no or maybe."),
            "json_object": ({"json_object": True}, f"Describe {topic} as a JSON object."),
        }[kind]
        out.append({"id": f"b{i}", "messages": [{"role": "user", "content": ask}], "structured_output": guide,
                    "max_tokens": max_tokens, "temperature": 0.7, "seed": 1000 + i})
    return out


def is_valid(line: Dict[str, Any], text: str) -> bool:
    g = line["structured_output"]
    try:
        if "json" in g:
            jsonschema.validate(json.loads(text), g["json"])
        elif "json_object" in g:
            return isinstance(json.loads(text), dict)
        elif "regex" in g:
            return re.fullmatch(g["regex"], text) is not None
        elif "choice" in g:
            return text in g["choice"]
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def pct(xs: List[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def engine_flags(args) -> List[str]:
    flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-new-tokens", str(args.max_tokens)]
    return flags + (["--model", args.model] if args.model else [])


def offline_on_group(group, model_dir, lines, warm, max_num_seqs, max_tokens):
    """Module-level (spawnable): warm-up batch, then the timed batch; every rank returns the driver's result."""
    from tpguide.dist import group as C
    from tpguide.engine import EngineConfig, build_engine
    from tpguide.engine.request_io import parse_request_lines

    engine = build_engine(group, model_dir, EngineConfig(max_num_seqs=max_num_seqs))
    result = None
    if group.is_driver:
        engine.generate(parse_request_lines([json.dumps(x) for x in warm], max_tokens))
        start = time.perf_counter()
        outs = engine.generate(parse_request_lines([json.dumps(x) for x in lines], max_tokens))
        result = ([o.to_json() for o in outs], time.perf_counter() - start)
        engine.shutdown()
    else:
        engine.run_worker()
    return C.broadcast_object(result, group)


def run_offline(args, lines) -> Dict[str, float]:
    from tpguide.dist.spawn import run_at_tp_size

    warm = [dict(x, id=f"warm-{x['id']}") for x in lines[:4]]
    outs, wall = run_at_tp_size(offline_on_group, args.tp, args.model, lines, warm, args.max_num_seqs,
                                args.max_tokens)[0]
    tokens = sum(len(o["token_ids"]) for o in outs)
    invalid = sum(o["finish_reason"] == "stop" and not is_valid(x, o["text"]) for o, x in zip(outs, lines))
    return {"requests": len(outs), "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "req_s": len(outs) / wall, "invalid": invalid}


async def client_loop(http: httpx.AsyncClient, queue: "asyncio.Queue", deadline: float, stats: Dict[str, list],
                      model: str) -> None:
    while time.monotonic() < deadline:
        try:
            line = queue.get_nowait()
        except asyncio.QueueEmpty:
            return
        body = {"model": model, "messages": line["messages"], "max_tokens": line["max_tokens"],
                "temperature": line["temperature"], "seed": line["seed"], "stream": True,
                "stream_options": {"include_usage": True}, "structured_outputs": line["structured_output"]}
        start, last, text, reason, tokens = time.perf_counter(), None, "", None, 0
        try:
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    stats["errors"].append(f"{r.status_code}: {(await r.aread())[:200]!r}")
                    continue
                async for raw in r.aiter_lines():
                    if not raw.startswith("data: ") or raw == "data: [DONE]":
                        continue
                    ch = json.loads(raw[6:])
                    if "error" in ch:
                        stats["errors"].append(ch["error"]["message"])
                        break
                    if ch.get("usage"):
                        tokens = ch["usage"]["completion_tokens"]
                    for c in ch["choices"]:
                        piece = c["delta"].get("content") or ""
                        if piece:
                            now = time.perf_counter()
                            if last is None:
                                stats["ttft"].append(now - start)
                            else:
                                stats["itl"].append(now - last)
                            last = now
                            text += piece
                        reason = c["finish_reason"] or reason
        except httpx.HTTPError as exc:
            stats["errors"].append(repr(exc))
            continue
        stats["tokens"].append(tokens)
        if reason == "stop" and not is_valid(line, text):
            stats["invalid"].append(line["id"])


async def run_clients(base_url: str, lines, clients: int, time_limit: float, model: str) -> Dict[str, Any]:
    queue: asyncio.Queue = asyncio.Queue()
    for x in lines:
        queue.put_nowait(x)
    stats: Dict[str, list] = {"ttft": [], "itl": [], "tokens": [], "errors": [], "invalid": []}
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=time_limit, limits=limits) as http:
        start = time.perf_counter()
        deadline = time.monotonic() + time_limit
        await asyncio.gather(*[client_loop(http, queue, deadline, stats, model) for _ in range(clients)])
        stats["wall_s"] = time.perf_counter() - start
    return stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds, per phase")
    p.add_argument("--rounds", type=int, default=1, help="alternate offline / server rounds, keep the best of each")
    p.add_argument("--model", default=None)
    p.add_argument("--dp", type=int, default=None,
                   help="compare D replicas against one (servers only, 1 thread per rank)")
    p.add_argument("--shared-prefix", action="store_true",
                   help="the shared-prefix mode (benchmarks/shared_prefix.py): --clients conversations of --turns "
                        "turns behind one tools system prompt, prefix caching on vs off")
    p.add_argument("--turns", type=int, default=8, help="--shared-prefix: turns per client (default 8)")
    args = p.parse_args(argv)
    if args.shared_prefix:
        from benchmarks.shared_prefix import run_shared_prefix

        return run_shared_prefix(args, engine_flags(args), pct)
    if not (1 <= args.clients <= 256 and 1 <= args.requests <= 4096):
        raise SystemExit("--clients must be in [1, 256] and --requests in [1, 4096]")
    lines = make_requests(args.requests, args.max_tokens)
    if args.dp is not None:
        return compare_data_parallel(args, lines)
    offline, stats = None, None
    with ServerProcess(args.tp, ["--served-model-name", "bench", "--max-waiting-requests", str(args.requests),
                                 *engine_flags(args)]) as srv:
        warm = asyncio.run(run_clients(srv.base_url, lines[:4], 4, args.time_limit, "bench"))  # compile grammars
        for _ in range(max(1, args.rounds)):
            off = run_offline(args, lines)
            offline = off if offline is None or off["wall_s"] < offline["wall_s"] else offline
            st = asyncio.run(run_clients(srv.base_url, lines, args.clients, args.time_limit, "bench"))
            stats = st if stats is None or st["wall_s"] < stats["wall_s"] else stats
    done, tokens, wall = len(stats["tokens"]), sum(stats["tokens"]), stats["wall_s"]
    ms = 1000.0
    print(f"bench_serve: {args.requests} guided requests (json schema / regex / choice / json_object, seeded "
          f"temperature 0.7, max_tokens {args.max_tokens}), tp {args.tp}, {args.clients} streaming clients, "
          f"best of {max(1, args.rounds)} alternating rounds; "
          f"warm-up errors {len(warm['errors'])}; the machine may be shared: compare the ratio only")
    print("| path | requests/s | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | errors | invalid |")
    print("|---|---|---|---|---|---|---|")
    print(f"| offline (generate.py's Engine.generate) | {offline['req_s']:.2f} | {offline['tok_s']:.1f} | - | - | 0 | "
          f"{offline['invalid']} |")
    print(f"| server, {args.clients} clients | {done / wall:.2f} | {tokens / wall:.1f} | "
          f"{pct(stats['ttft'], 50) * ms:.0f} / {pct(stats['ttft'], 99) * ms:.0f} | "
          f"{pct(stats['itl'], 50) * ms:.0f} / {pct(stats['itl'], 99) * ms:.0f} | {len(stats['errors'])} | "
          f"{len(stats['invalid'])} |")
    print(f"server / offline throughput: {(tokens / wall) / offline['tok_s']:.2f}")
    for e in stats["errors"][:5]:
        print(f"  error: {e}")
    return 0


def compare_data_parallel(args, lines) -> int:
    """Server throughput at ``--dp`` replicas x tp ``--tp`` against 1 x tp ``--tp``, same requests, one run."""
    if args.dp < 2:
        raise SystemExit(f"--dp must be >= 2, got {args.dp}")
    flags = ["--served-model-name", "bench", "--max-waiting-requests", str(args.requests), "--threads", "1",
             *engine_flags(args)]
    best: Dict[int, Dict[str, Any]] = {}
    for _ in range(max(1, args.rounds)):
        for dp in (1, args.dp):
            extra = ["--data-parallel-size", str(dp)] if dp > 1 else []
            with ServerProcess(dp * args.tp, [*flags, *extra]) as srv:
                asyncio.run(run_clients(srv.base_url, lines[:4], 4, args.time_limit, "bench"))  # compile grammars
                st = asyncio.run(run_clients(srv.base_url, lines, args.clients, args.time_limit, "bench"))
            if dp not in best or st["wall_s"] < best[dp]["wall_s"]:
                best[dp] = st
    print(f"bench_serve --dp: {args.requests} guided requests (max_tokens {args.max_tokens}), {args.clients} "
          f"streaming clients, 1 thread per rank, best of {max(1, args.rounds)} rounds; the machine may be "
          f"shared: compare the ratio only")
    print("| replicas x tp | requests/s | output tok/s | TTFT p50 / p99 (ms) | errors | invalid |")
    print("|---|---|---|---|---|---|")
    for dp, st in sorted(best.items()):
        wall = st["wall_s"]
        print(f"| {dp} x {args.tp} | {len(st['tokens']) / wall:.2f} | {sum(st['tokens']) / wall:.1f} | "
              f"{pct(st['ttft'], 50) * 1000:.0f} / {pct(st['ttft'], 99) * 1000:.0f} | {len(st['errors'])} | "
              f"{len(st['invalid'])} |")
    tok = {dp: sum(st["tokens"]) / st["wall_s"] for dp, st in best.items()}
    print(f"throughput {args.dp} x {args.tp} / 1 x {args.tp}: {tok[args.dp] / tok[1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
