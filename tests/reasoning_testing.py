"""Requests and checks shared by the reasoning tests: budgets x guides x sampling, and what a valid answer is."""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List

import jsonschema

#: ``</think>`` of the tiny reasoning checkpoint (tpguide/model/tiny_reasoning.py).
THINK_END_ID = 49153
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
GUIDES = {"json": {"json": SCHEMA, "json_whitespace": "compact"}, "regex": {"regex": "(yes|no)[.!]"},
          "choice": {"choice": ["red", "green", "blue"]}}
BUDGETS = (0, 1, 8, 32)
ANSWER_TOKENS = 24  # room for the answer after the budget


def reasoning_requests() -> List[Dict[str, Any]]:
    """Budgets 0/1/8/32 x JSON schema, regex, choice, greedy and seeded in turn; enable_thinking false; unguided.

    Each guide and each budget runs both greedy and seeded requests (one of the two per pair, so the runs
    stay short on 2 cores).
    """
    lines = []
    for b, budget in enumerate(BUDGETS):
        for g, (name, guide) in enumerate(GUIDES.items()):
            sampling = {} if (b + g) % 2 == 0 else {"temperature": 0.8, "seed": 7 + budget}
            request_id = f"{name}-{budget}-{'seeded' if sampling else 'greedy'}"
            lines.append({"id": request_id, "messages": [{"role": "user", "content": f"{request_id}?"}],
                          "structured_output": guide,
                          "thinking_token_budget": budget, "max_tokens": budget + ANSWER_TOKENS, "logprobs": 1,
                          **sampling})
    lines.append({"id": "no-thinking", "messages": [{"role": "user", "content": "json, no thinking?"}],
                  "chat_template_kwargs": {"enable_thinking": False}, "structured_output": GUIDES["json"],
                  "max_tokens": ANSWER_TOKENS, "logprobs": 1})
    lines.append({"id": "unguided", "messages": [{"role": "user", "content": "hi"}], "thinking_token_budget": 4,
                  "max_tokens": 12, "logprobs": 1})
    lines.append({"id": "no-budget", "messages": [{"role": "user", "content": "json, no budget?"}],
                  "structured_output": GUIDES["json"], "max_tokens": 12, "logprobs": 1})
    return lines


def answer_is_valid(guide: Dict[str, Any], text: str) -> bool:
    """The answer satisfies its guide."""
    if "json" in guide:
        try:
            jsonschema.validate(json.loads(text), guide["json"])
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if "regex" in guide:
        return re.fullmatch(guide["regex"], text) is not None
    return text in guide["choice"]


def check_reasoning_outputs(lines: List[Dict[str, Any]], outputs: List[Dict[str, Any]]) -> None:
    """Every budgeted request thought at most its budget, then answered validly ("stop" unless max_tokens cut it)."""
    for line, out in zip(lines, outputs):
        ids, budget = out["token_ids"], line.get("thinking_token_budget")
        assert out["finish_reason"] in ("stop", "length"), out
        if out["finish_reason"] == "length":
            assert len(ids) == line["max_tokens"], out
        if line["id"] == "no-thinking":
            assert "reasoning" not in out and THINK_END_ID not in ids and out["finish_reason"] == "stop", out
            assert answer_is_valid(line["structured_output"], out["text"]), out
            continue
        assert "reasoning" in out, out
        if line["id"] == "no-budget":  # a guided request cannot stop while it thinks
            assert out["finish_reason"] == "length" and THINK_END_ID not in ids[:-1], out
            continue
        assert THINK_END_ID in ids[:budget + 1], out  # </think> forced at the budget at the latest
        if line.get("structured_output") is not None:
            assert out["finish_reason"] == "stop", out
            assert answer_is_valid(line["structured_output"], out["text"]), out


def key(outputs: List[Dict[str, Any]]) -> List[tuple]:
    """What must be identical between runs: ids, logprobs, texts, finish reasons."""
    return [(o["id"], o["token_ids"], o.get("logprobs"), o.get("reasoning"), o["text"], o["finish_reason"])
            for o in outputs]
