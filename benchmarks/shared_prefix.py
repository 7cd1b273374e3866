"""The shared-prefix mode of ``bench_serve``: agents behind one long tools system prompt, caching on vs off.

``--clients`` conversations run at once against ``launch/serve.py``; each
sends ``--turns`` chat turns in a row, every turn the whole conversation so
far (the same ~1,500-token tools system prompt, then its own earlier turns
and the model's replies, then a new question), streamed.  The server runs
twice, with prefix caching on and with ``--no-prefix-caching``; for each:
time to first token (p50 / p99), output tokens per second over the phase's
wall time, and the prefix-cache hit rate from ``GET /metrics``
(``tpguide:prefix_cache_hits`` / ``tpguide:prefix_cache_queries``, tokens).
Only the ratio between the two phases of one run means something on a
shared machine; nothing here is a test threshold.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any, Dict, List

import httpx

from tests.server_process import ServerProcess

WORDS = ("city", "date", "amount", "currency", "query", "limit", "user", "order", "status", "region", "unit", "lang")


def tools_system_prompt(num_tools: int = 10) -> str:
    """A deterministic tool list rendered into a system prompt (about 1,500 SmolLM2 tokens at 10 tools)."""
    tools = []
    for i in range(num_tools):
        params = {w: {"type": "string", "description": f"the {w} the tool {i} works on"} for w in WORDS[i % 5:i % 5 + 4]}
        tools.append({"name": f"tool_{i}_{WORDS[i % len(WORDS)]}", "description": f"Looks up {WORDS[i % 7]} data "
                      f"for a request of kind {i}; returns JSON.", "parameters": {"type": "object", "properties": params,
                                                                                 "required": sorted(params)[:2]}})
    return ("You are an agent. You may call these tools by answering with a JSON object {\"name\", \"arguments\"}:\n"
            + "\n".join(json.dumps(t) for t in tools))


async def _conversation(http: httpx.AsyncClient, system: str, c: int, turns: int, max_tokens: int,
                        stats: Dict[str, list]) -> None:
    messages: List[Dict[str, Any]] = [{"role": "system", "content": system}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Client {c}, turn {t}: which tool fits task {c * 31 + t}?"})
        body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        start, first, text, tokens = time.perf_counter(), None, "", 0
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                stats["errors"].append(f"{r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for raw in r.aiter_lines():
                if not raw.startswith("data: ") or raw == "data: [DONE]":
                    continue
                chunk = json.loads(raw[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                    stats["prompt_tokens"].append(chunk["usage"]["prompt_tokens"])
                for choice in chunk.get("choices", []):
                    piece = choice["delta"].get("content") or ""
                    if piece and first is None:
                        first = time.perf_counter()
                        stats["ttft"].append(first - start)
                    text += piece
        stats["tokens"].append(tokens)
        messages.append({"role": "assistant", "content": text})


def _metric(body: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:_total)? ([0-9.e+]+)$", body, re.M)
    return float(m.group(1)) if m else float("nan")


async def _phase(base_url: str, clients: int, turns: int, max_tokens: int, time_limit: float) -> Dict[str, Any]:
    stats: Dict[str, list] = {"ttft": [], "tokens": [], "errors": [], "prompt_tokens": []}
    system = tools_system_prompt()
    async with httpx.AsyncClient(base_url=base_url, timeout=time_limit,
                                 limits=httpx.Limits(max_connections=clients + 4)) as http:
        start = time.perf_counter()
        await asyncio.gather(*[_conversation(http, system, c, turns, max_tokens, stats) for c in range(clients)])
        stats["wall_s"] = time.perf_counter() - start
        body = (await http.get("/metrics")).text
    stats["queries"] = _metric(body, "tpguide:prefix_cache_queries")
    stats["hits"] = _metric(body, "tpguide:prefix_cache_hits")
    stats["preemptions"] = _metric(body, "tpguide:num_preemptions")
    return stats


def run_shared_prefix(args, engine_flags: List[str], pct) -> int:
    """Both phases (caching on, then off) and the table; returns the exit status."""
    results = {}
    for name, extra in (("prefix caching on", []), ("prefix caching off", ["--no-prefix-caching"])):
        with ServerProcess(args.tp, ["--served-model-name", "bench", "--max-waiting-requests", str(args.clients * 2),
                                     *engine_flags, *extra]) as srv:
            results[name] = asyncio.run(_phase(srv.base_url, args.clients, args.turns, args.max_tokens,
                                               args.time_limit))
    prompt = results["prefix caching on"]["prompt_tokens"]
    print(f"bench_serve --shared-prefix: {args.clients} clients x {args.turns} turns, one tools system prompt, "
          f"prompts {min(prompt, default=0)}..{max(prompt, default=0)} tokens, greedy, max_tokens "
          f"{args.max_tokens}, tp {args.tp}; the machine may be shared: compare the ratio only")
    print("| server | TTFT p50 / p99 (ms) | output tok/s | wall (s) | prefix hit rate (tokens) | preemptions | errors |")
    print("|---|---|---|---|---|---|---|")
    for name, st in results.items():
        rate = st["hits"] / st["queries"] if st["queries"] else 0.0
        print(f"| {name} | {pct(st['ttft'], 50) * 1000:.0f} / {pct(st['ttft'], 99) * 1000:.0f} | "
              f"{sum(st['tokens']) / st['wall_s']:.1f} | {st['wall_s']:.1f} | {rate:.1%} | {st['preemptions']:.0f} | "
              f"{len(st['errors'])} |")
        for e in st["errors"][:3]:
            print(f"  error: {e}")
    on, off = results["prefix caching on"], results["prefix caching off"]
    print(f"caching on / off: TTFT p50 {pct(on['ttft'], 50) / pct(off['ttft'], 50):.2f}x, throughput "
          f"{(sum(on['tokens']) / on['wall_s']) / (sum(off['tokens']) / off['wall_s']):.2f}x")
    return 0
