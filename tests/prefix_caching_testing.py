"""Support for the prefix-caching tests: engine configs, request sets, a multi-turn chat, output keys."""

from __future__ import annotations

import dataclasses
import json

import torch

from tpguide.engine import EngineConfig
from tpguide.engine.request_io import parse_request_lines

CACHING_OFF = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1536, dtype=torch.bfloat16,
                           enable_prefix_caching=False)
CACHING_ON = dataclasses.replace(CACHING_OFF, enable_prefix_caching=True)
MAX_TOKENS = 10


def with_sampled_copies(requests: list) -> list:
    """Each request greedy (``logprobs: 1``) and once more with seeded sampling."""
    out = []
    for i, r in enumerate(requests):
        greedy = {**r, "max_tokens": min(r.get("max_tokens", MAX_TOKENS), MAX_TOKENS), "logprobs": 1}
        greedy.setdefault("temperature", 0.0)
        out += [greedy, {**greedy, "id": f"{r['id']}-sampled", "temperature": 0.8, "top_p": 0.95, "seed": 100 + i}]
    return out


def outputs_key(outputs: list) -> list:
    return [(o["id"], o["finish_reason"], o["token_ids"], json.dumps(o.get("logprobs"))) for o in outputs]


def run(engine, request_dicts: list) -> list:
    requests = parse_request_lines([json.dumps(r) for r in request_dicts], MAX_TOKENS)
    return [o.to_json() for o in engine.generate(requests)]


def chat_turns(engine, conversations: int = 3, turns: int = 3) -> list:
    """Each conversation's turn ``t`` repeats turns ``< t`` (with the model's replies) and adds a question."""
    history = [[] for _ in range(conversations)]
    outputs = []
    for t in range(turns):
        batch = []
        for c in range(conversations):
            history[c].append({"role": "user", "content": f"Conversation {c}, question {t}: say more about {c + t}."})
            batch.append({"id": f"c{c}-t{t}", "messages": list(history[c]), "max_tokens": 8, "logprobs": 1,
                          "temperature": 0.7 if c % 2 else 0.0, "seed": c})
        outs = run(engine, batch)
        for c, o in enumerate(outs):
            history[c].append({"role": "assistant", "content": o["text"]})
        outputs += outs
    return outputs
