"""Reasoning demo: the tiny random Qwen3 thinks under a budget, then answers in its schema; drafts on and off.

In one process, at tp 1, on the tiny random-weight reasoning checkpoint of
:mod:`tpguide.model.tiny_reasoning` (built into ``--model-dir`` once), with
``--reasoning-parser qwen3``: one JSON-schema, one regex and one choice
request per thinking budget in ``--budgets`` (greedy), plus one JSON request
with ``enable_thinking: false``.  It runs them without drafts and with
grammar drafts (the default, which also drafts the forced ``</think>`` at
the budget and the answer's forced text after it) and prints, per request,
the reasoning length, the answer and whether it validates; then the forward
passes per generated token of the drafted run, its tok/s next to the plain
run's, and whether every request's tokens are the same in both runs (they
must be).  A random model thinks in noise: the budget is what ends its
thinking.  tok/s are noisy on a shared machine: compare them within one run.

Usage::

    python benchmarks/reasoning_demo.py [--model-dir DIR] [--budgets 0,8,32] [--max-answer-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

import jsonschema

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine
from tpguide.engine.request_io import parse_request_lines
from tpguide.model.tiny_reasoning import write_tiny_reasoning_model

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}
GUIDES = {"json": {"json": SCHEMA}, "regex": {"regex": r"[0-9]{1,3} (km|mi)"}, "choice": {"choice": ["yes", "no"]}}


def requests(budgets, max_answer_tokens):
    lines = [{"id": f"{name}-budget-{b}", "messages": [{"role": "user", "content": f"{name} {b}"}],
              "structured_output": guide, "thinking_token_budget": b, "max_tokens": b + max_answer_tokens}
             for b in budgets for name, guide in GUIDES.items()]
    lines.append({"id": "json-no-thinking", "messages": [{"role": "user", "content": "json"}],
                  "chat_template_kwargs": {"enable_thinking": False}, "structured_output": GUIDES["json"],
                  "max_tokens": max_answer_tokens})
    return lines


def valid(guide, text):
    if "json" in guide:
        try:
            jsonschema.validate(json.loads(text), guide["json"])
            return True
        except (ValueError, jsonschema.ValidationError):
            return False
    if "regex" in guide:
        return re.fullmatch(guide["regex"], text) is not None
    return text in guide["choice"]


def run(model_dir, lines, method):
    engine = build_engine(TPGroup(), model_dir, EngineConfig(speculative_method=method, reasoning_parser="qwen3",
                                                             max_model_len=256))
    reqs = parse_request_lines([json.dumps(x) for x in lines], 64)
    start = time.perf_counter()
    outputs = [o.to_json() for o in engine.generate(reqs)]
    seconds = time.perf_counter() - start
    stats = engine.speculation_stats()
    engine.shutdown()
    return outputs, seconds, stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="where the tiny reasoning checkpoint is (built there when missing)")
    p.add_argument("--budgets", default="0,8,32")
    p.add_argument("--max-answer-tokens", type=int, default=32)
    args = p.parse_args()
    model_dir = Path(args.model_dir or Path(tempfile.gettempdir()) / "tpguide-tiny-reasoning")
    if not (model_dir / "config.json").is_file():
        write_tiny_reasoning_model(model_dir)
    lines = requests([int(b) for b in args.budgets.split(",")], args.max_answer_tokens)
    plain, plain_s, _ = run(str(model_dir), lines, None)
    drafted, drafted_s, stats = run(str(model_dir), lines, "grammar")
    print(f"{'request':<20} {'finish':<7} {'think':>5}  valid  answer")
    for line, out in zip(lines, drafted):
        think = out["token_ids"].index(49153) if "reasoning" in out and 49153 in out["token_ids"] else "-"
        print(f"{out['id']:<20} {out['finish_reason']:<7} {think:>5}  {str(valid(line['structured_output'], out['text'])):<5}  "
              f"{out['text']!r}")
    tokens = sum(len(o["token_ids"]) for o in plain)
    same = [o["token_ids"] for o in plain] == [o["token_ids"] for o in drafted]
    print(f"grammar drafts: {stats.passes_per_token:.3f} forward passes per token, {stats.num_forced_drafted} forced "
          f"tokens drafted ({stats.num_forced_accepted} accepted); {tokens / drafted_s:.1f} tok/s vs "
          f"{tokens / plain_s:.1f} without drafts ({plain_s / drafted_s:.2f}x); same tokens: {same}")


if __name__ == "__main__":
    main()
