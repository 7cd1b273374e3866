"""Test support for grammar drafts: tool-call request lines, a spawnable engine run with its counts, an output key."""

from __future__ import annotations

import json

from tpguide.dist import group as C
from tpguide.engine import build_engine
from tpguide.engine.request_io import parse_request_lines
from tpguide.serving.protocol import parse_request

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}


def tool_call_lines(backend: str) -> list:
    """Request lines of two chat bodies, ``tool_choice`` "required" and named, as the server maps them."""
    lines = []
    for name, choice in (("required", "required"), ("named", {"type": "function",
                                                             "function": {"name": "get_weather"}})):
        body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
                "tool_choice": choice, "temperature": 0, "max_tokens": 24, "logprobs": True}
        (line,) = parse_request(body, "chat", f"tool-{name}", backend=backend).lines
        lines.append(line)
    return lines


def run(group, model_dir, lines, config):
    """Module-level (spawnable): outputs and speculative counts on every rank."""
    engine = build_engine(group, model_dir, config)
    result = None
    if group.is_driver:
        outputs = [o.to_json() for o in engine.generate(parse_request_lines([json.dumps(r) for r in lines], 64))]
        engine.shutdown()
        spec = engine.driver.spec
        result = (outputs, spec.stats if spec is not None else None)
    else:
        engine.run_worker()
    return C.broadcast_object(result, group)


def key(outputs: list) -> list:
    return [(o["id"], o["finish_reason"], o["error"], o["token_ids"], json.dumps(o.get("logprobs")))
            for o in outputs]
