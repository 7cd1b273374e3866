"""A server soak on loopback: many concurrent streaming guided requests, clients that leave mid-stream, malformed
requests; then the server must be idle again (no running request, no KV block in use) and every request accounted for.

    PYTHONPATH=$PWD python benchmarks/soak_server.py                       # 2,000 requests, 256 at once
    PYTHONPATH=$PWD python benchmarks/soak_server.py --requests 400 --concurrency 64 --tp 2

It starts ``launch/serve.py`` on a free 127.0.0.1 port (or uses ``--base-url``,
which must be a loopback address), and sends ``--requests`` requests, at most
``--concurrency`` at once, each one drawn with a fixed seed:

* ``--malformed-frac`` (5 %) malformed: bad JSON, an unknown field, a schema
  without ``schema``, ``max_tokens`` 0, a Responses ``input: []``; each must get a 400;
* ``--disconnect-frac`` (10 %) streamed, and the client closes the connection
  after its first event (cancelled: its answer is not counted);
* the rest streamed and guided by a JSON schema, a quarter through
  ``/v1/responses``, the others through ``/v1/chat/completions``; an answer
  that finished by itself (``stop``) must validate.

Bounded: no request starts after ``--time-limit-s``; each has a ``--request-timeout-s``.
It prints completed / valid / errors by kind, p50 and p99 of the time to the
first content token and of the latency, the server's RSS (every process of its
session, in MiB) at the start and at the end, and ``tpguide:num_requests_running``
and ``tpguide:kv_cache_blocks_used`` once the load is over.  It asserts
nothing about time; it exits 1 when a request is lost (neither answered,
failed with an error, nor cancelled) or the server is not idle after the load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional
from urllib.parse import urlparse

import httpx
import jsonschema

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
QUESTIONS = ["Is the sky blue? Give ok and a number.", "Pick a number and say if it is ok.",
             "Answer in JSON: ok and n.", "Is 7 odd? JSON with ok and n."]
#: (name, path, body or raw bytes): each must get a 400
MALFORMED = [("bad_json", "/v1/chat/completions", b'{"model": '),
             ("unknown_field", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}),
             ("schema_missing", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                         "response_format": {"type": "json_schema",
                                                                             "json_schema": {"name": "x"}}}),
             ("max_tokens_0", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
             ("responses_empty_input", "/v1/responses", {"input": []})]


@dataclass
class Tally:
    """What happened to the requests."""

    outcomes: Counter = field(default_factory=Counter)  # completed_stop, completed_length, cancelled, error:<kind>
    valid: int = 0
    ttft_s: List[float] = field(default_factory=list)
    latency_s: List[float] = field(default_factory=list)
    not_started: int = 0


def percentile(xs: List[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``xs``; NaN when empty."""
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def session_rss_mib(leader_pid: int) -> float:
    """Resident memory of every process in ``leader_pid``'s session (the server and its ranks), MiB (Linux /proc)."""
    total_kib = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            sid = int(stat.rsplit(")", 1)[1].split()[3])  # after the name: state ppid pgrp session
            if sid != leader_pid:
                continue
            with open(f"/proc/{entry}/status") as f:
                total_kib += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
        except (OSError, ValueError, IndexError):
            continue
    return total_kib / 1024


def gauges(base_url: str) -> Dict[str, float]:
    """``tpguide:num_requests_running`` and ``tpguide:kv_cache_blocks_used`` from ``/metrics``."""
    text = httpx.get(base_url + "/metrics", timeout=30).text
    out = {}
    for name in ("tpguide:num_requests_running", "tpguide:kv_cache_blocks_used"):
        m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else float("nan")
    return out


def _body(kind: str, model: str, rng: random.Random, max_tokens: int) -> Dict[str, Any]:
    question = rng.choice(QUESTIONS)
    if kind == "responses":
        return {"model": model, "input": question, "max_output_tokens": max_tokens, "stream": True,
                "temperature": 0.7, "text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA,
                                                        "strict": True}}}
    return {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0.7, "seed": rng.randrange(1 << 30),
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}


def _event(line: str) -> Optional[Dict[str, Any]]:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return json.loads(line[6:])


async def _streamed(http: httpx.AsyncClient, path: str, body: Dict[str, Any], leave_early: bool, tally: Tally) -> None:
    responses = path == "/v1/responses"
    start, first, text, reason = time.perf_counter(), None, "", None
    async with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            tally.outcomes[f"error:http_{r.status_code}"] += 1
            await r.aread()
            return
        async for line in r.aiter_lines():
            ev = _event(line)
            if ev is None:
                continue
            if leave_early:  # close the connection after the first event: the server must abort the request
                tally.outcomes["cancelled"] += 1
                return
            if "error" in ev and not responses:
                tally.outcomes[f"error:{ev['error'].get('code') or ev['error'].get('type')}"] += 1
                return
            if responses:
                kind = ev.get("type")
                piece = ev.get("delta", "") if kind == "response.output_text.delta" else ""
                if kind in ("response.completed", "response.incomplete"):
                    reason = "stop" if kind == "response.completed" else "length"
                elif kind in ("error", "response.failed"):
                    tally.outcomes[f"error:{ev.get('code') or 'response_failed'}"] += 1
                    return
            else:
                choice = ev["choices"][0] if ev.get("choices") else {}
                piece = (choice.get("delta") or {}).get("content") or ""
                reason = choice.get("finish_reason") or reason
            if piece and first is None:
                first = time.perf_counter() - start
            text += piece
    if reason is None:
        tally.outcomes["lost:stream_ended_without_finish"] += 1
        return
    tally.outcomes[f"completed_{reason}"] += 1
    tally.latency_s.append(time.perf_counter() - start)
    if first is not None:
        tally.ttft_s.append(first)
    if reason == "stop":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
            tally.valid += 1
        except (ValueError, jsonschema.ValidationError):
            tally.outcomes["invalid_answer"] += 1


async def _malformed(http: httpx.AsyncClient, rng: random.Random, model: str, tally: Tally) -> None:
    name, path, body = rng.choice(MALFORMED)
    if isinstance(body, bytes):
        r = await http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = await http.post(path, json={"model": model, **body})
    tally.outcomes["malformed_400" if r.status_code == 400 else f"malformed_got_{r.status_code} ({name})"] += 1


async def run_soak(base_url: str, model: str, requests: int = 2000, concurrency: int = 256, max_tokens: int = 32,
                   disconnect_frac: float = 0.10, malformed_frac: float = 0.05, time_limit_s: float = 1800.0,
                   request_timeout_s: float = 600.0, seed: int = 0) -> Tally:
    """Send the load (see the module docstring) to ``base_url``; the tally of what happened.

    Raises
    ------
    ValueError
        ``base_url`` is not a loopback address.
    """
    host = urlparse(base_url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"the soak runs on loopback only, got host {host!r}")
    rng = random.Random(seed)
    plan = []
    for _ in range(requests):
        u = rng.random()
        kind = "malformed" if u < malformed_frac else "leave" if u < malformed_frac + disconnect_frac else "guided"
        plan.append((kind, rng.random() < 0.25, random.Random(rng.randrange(1 << 30))))
    tally, gate = Tally(), asyncio.Semaphore(concurrency)
    deadline = time.monotonic() + time_limit_s
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=base_url, timeout=request_timeout_s, limits=limits) as http:
        async def one(kind: str, via_responses: bool, r: random.Random) -> None:
            async with gate:
                if time.monotonic() > deadline:
                    tally.not_started += 1
                    return
                try:
                    if kind == "malformed":
                        await _malformed(http, r, model, tally)
                    else:
                        path = "/v1/responses" if via_responses else "/v1/chat/completions"
                        body = _body("responses" if via_responses else "chat", model, r, max_tokens)
                        await _streamed(http, path, body, kind == "leave", tally)
                except httpx.HTTPError as exc:
                    tally.outcomes[f"error:client_{type(exc).__name__}"] += 1

        await asyncio.gather(*[one(*p) for p in plan])
    return tally


def wait_idle(base_url: str, timeout_s: float = 60.0) -> Dict[str, float]:
    """The gauges once no request runs and no KV block is in use (or after ``timeout_s``)."""
    end = time.monotonic() + timeout_s
    while True:
        g = gauges(base_url)
        if (g["tpguide:num_requests_running"] == 0 and g["tpguide:kv_cache_blocks_used"] == 0) \
                or time.monotonic() > end:
            return g
        time.sleep(0.5)


def report(tally: Tally, requests: int, wall_s: float, rss: tuple, idle: Dict[str, float]) -> int:
    """Print the figures; the number of problems (lost requests, a busy server after the load)."""
    o = tally.outcomes
    lost = sum(v for k, v in o.items() if k.startswith("lost"))
    accounted = sum(v for k, v in o.items() if k != "invalid_answer") + tally.not_started  # one outcome each
    print(f"requests {requests}, wall {wall_s:.1f} s, not started (time limit) {tally.not_started}")
    print(f"completed {o['completed_stop'] + o['completed_length']} (stop {o['completed_stop']}, "
          f"length {o['completed_length']}), valid {tally.valid}, invalid answers {o['invalid_answer']}, "
          f"cancelled {o['cancelled']}, malformed -> 400 {o['malformed_400']}")
    errors = {k: v for k, v in sorted(o.items()) if k.startswith(("error:", "malformed_got", "lost")) and v}
    print(f"errors by kind: {errors or 'none'}")
    print(f"TTFT p50 {percentile(tally.ttft_s, 50) * 1e3:.0f} ms, p99 {percentile(tally.ttft_s, 99) * 1e3:.0f} ms; "
          f"latency p50 {percentile(tally.latency_s, 50):.2f} s, p99 {percentile(tally.latency_s, 99):.2f} s")
    print(f"server RSS (its session) start {rss[0]:.0f} MiB, end {rss[1]:.0f} MiB")
    running, used = idle["tpguide:num_requests_running"], idle["tpguide:kv_cache_blocks_used"]
    print(f"after the load: running requests {running:g}, KV blocks in use {used:g}")
    problems = lost + (accounted != requests) + (running != 0) + (used != 0) + o["invalid_answer"]
    print("OK: every request answered, failed with its error, or cancelled; the server is idle" if not problems
          else f"PROBLEMS: {problems} (lost {lost}, accounted {accounted} of {requests})")
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--disconnect-frac", type=float, default=0.10)
    p.add_argument("--malformed-frac", type=float, default=0.05)
    p.add_argument("--time-limit-s", type=float, default=1800.0, help="no request starts after this (default 1800)")
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--model", default=None, help="--model of the server (default: the embedded model)")
    p.add_argument("--base-url", default=None, help="a running server on loopback (default: start one)")
    p.add_argument("--served-model-name", default="soak")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1,
                   help="run the load this many times on the same server (RSS after each: growth vs warm-up)")
    args = p.parse_args(argv)
    srv = None
    if args.base_url is None:
        from tests.server_process import ServerProcess

        flags = ["--served-model-name", args.served_model_name, "--max-num-seqs", str(args.max_num_seqs),
                 "--max-waiting-requests", str(args.concurrency), "--max-model-len", "512",
                 *(["--model", args.model] if args.model else [])]
        srv = ServerProcess(args.tp, flags).start()
        base_url = srv.base_url
    else:
        base_url = args.base_url
    try:
        problems = 0
        for k in range(args.rounds):
            rss_start = session_rss_mib(srv.proc.pid) if srv else float("nan")
            start = time.perf_counter()
            tally = asyncio.run(run_soak(base_url, args.served_model_name, args.requests, args.concurrency,
                                         args.max_tokens, args.disconnect_frac, args.malformed_frac,
                                         args.time_limit_s, args.request_timeout_s, args.seed + k))
            wall = time.perf_counter() - start
            idle = wait_idle(base_url)
            rss_end = session_rss_mib(srv.proc.pid) if srv else float("nan")
            print(f"-- round {k + 1} of {args.rounds}")
            problems += report(tally, args.requests, wall, (rss_start, rss_end), idle)
        return 1 if problems else 0
    finally:
        if srv is not None:
            srv.stop()


if __name__ == "__main__":
    sys.exit(main())
