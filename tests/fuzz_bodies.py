"""Mutated OpenAI request bodies for the server fuzz (tests/test_serving_faults.py, benchmarks/fuzz_server.py).

:func:`fuzz_bodies` starts from valid chat and completion bodies (JSON
schema, JSON object, regex and choice guides, tools with each
``tool_choice``, streaming, logprobs, stop strings, logit bias) and applies
one or two random mutations to each: a field's type changed, an odd number
(NaN, infinities, huge, negative, fractional), odd Unicode (lone surrogates,
NUL, bidi and zero-width marks, combining runs, long text), schemas nested
deep or with a keyword misspelt, hundreds of tools or a broken tool, a field
removed or unknown, or the JSON text itself broken.  Deterministic for a
seed.  Each body is ``(endpoint, raw bytes, stream)``.
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any, Iterator, List, Tuple

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age"], "additionalProperties": False}
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}

ODD_TEXT = ["\ud800", "a\udfffb", "\x00", "\u202e\u200f\u200b", "e" + "\u0301" * 50, "😀" * 40, "\\u0000",
            "<|im_end|>", "{{ raise('x') }}", "%s%n", "x" * 5000, "", " ", "\n\t", "\ufeff", "\U0010ffff"]
ODD_NUMBERS = [float("nan"), float("inf"), -float("inf"), 10 ** 30, -(10 ** 30), -1, 0, 0.5, 2 ** 31, 2 ** 63,
               1e-300, True, 3.7]
ODD_VALUES = [None, [], {}, "x", 7, True, [1, "a"], {"a": 1}]
KEYWORD_TYPOS = {"properties": "propertieC", "type": "tpye", "required": "requird", "items": "itemz",
                 "maxLength": "maxLenght", "enum": "enun"}


def seed_bodies(model: str) -> List[Tuple[str, dict]]:
    """Valid bodies, one per kind of request the server takes."""
    user = [{"role": "user", "content": "Describe a person."}]
    chat = {"model": model, "messages": user, "max_tokens": 12, "temperature": 0}
    return [
        ("chat", dict(chat, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})),
        ("chat", dict(chat, response_format={"type": "json_object"})),
        ("chat", dict(chat, structured_outputs={"regex": "[a-z]{1,8}"})),
        ("chat", dict(chat, structured_outputs={"choice": ["yes", "no"]})),
        ("chat", dict(chat, tools=[TOOL], tool_choice="required")),
        ("chat", dict(chat, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})),
        ("chat", dict(chat, tools=[TOOL], tool_choice="auto", stream=True)),
        ("chat", dict(chat, logprobs=True, top_logprobs=2, stop=["."], seed=3, temperature=0.7, top_p=0.9)),
        ("chat", dict(chat, messages=[{"role": "system", "content": "Be brief."}, *user,
                                      {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Go"}],
                      logit_bias={"42": -5}, presence_penalty=0.5, n=2)),
        ("completion", {"model": model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}),
        ("completion", {"model": model, "prompt": "JSON:", "max_tokens": 10, "stream": True, "echo": False,
                        "response_format": {"type": "json_object"}}),
    ]


def _paths(obj: Any, prefix=()) -> List[tuple]:
    """Every path (tuple of keys / indices) into ``obj``, containers included."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def _set(obj: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    node = obj
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return obj


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


def _mutate(rng: random.Random, body: dict) -> Any:
    kind = rng.choice(["type", "number", "text", "schema_depth", "schema_typo", "tools", "drop", "unknown",
                       "key_text"])
    paths = [p for p in _paths(body) if p]
    if kind == "type":
        return _set(body, rng.choice(paths), rng.choice(ODD_VALUES))
    if kind == "number":
        numeric = [p for p in paths if p[-1] in ("max_tokens", "temperature", "top_p", "n", "seed", "top_logprobs",
                                                  "presence_penalty", "maxLength", "minimum", "maximum", "maxItems")]
        return _set(body, rng.choice(numeric or paths), rng.choice(ODD_NUMBERS))
    if kind == "text":
        strings = [p for p in paths if isinstance(_get(body, p), str)]
        return _set(body, rng.choice(strings or paths), rng.choice(ODD_TEXT))
    if kind == "key_text":
        dicts = [p for p in [()] + paths if isinstance(_get(body, p), dict) and _get(body, p)]
        node = _get(body, rng.choice(dicts))
        key = rng.choice(list(node))
        node[key + rng.choice(ODD_TEXT[:6])] = node.pop(key)
        return body
    if kind == "schema_depth":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "deep", "schema": _deep_schema(rng.choice([8, 20, 40, 70]))}}
        return body
    if kind == "schema_typo":
        schema = copy.deepcopy(SCHEMA)
        for _ in range(rng.randint(1, 2)):
            word = rng.choice(list(KEYWORD_TYPOS))
            nodes = [schema, *schema.get("properties", {}).values()]
            node = next((n for n in nodes if word in n), schema)
            if word in node:
                node[KEYWORD_TYPOS[word]] = node.pop(word)
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
        return body
    if kind == "tools":  # copies: a later mutation of this body must not reach the module's TOOL
        choice = rng.randrange(4)
        if choice == 0:
            body["tools"] = [dict(copy.deepcopy(TOOL), function=dict(copy.deepcopy(TOOL["function"]), name=f"f{i}"))
                             for i in range(300)]
        elif choice == 1:
            body["tools"] = copy.deepcopy([TOOL, TOOL])  # a name twice
        elif choice == 2:
            body["tools"] = [{"type": "function", "function": {"name": "broken", "parameters": "not a schema"}}]
        else:
            body["tools"] = copy.deepcopy([TOOL])
            body["tool_choice"] = {"type": "function", "function": {"name": "nope"}}
        return body
    if kind == "drop":
        path = rng.choice(paths)
        parent = _get(body, path[:-1])
        parent.pop(path[-1]) if isinstance(parent, dict) else parent.pop(path[-1])
        return body
    body[rng.choice(["best_of", "frobnicate", "suffix", "functions", "x" * 300])] = rng.choice(ODD_VALUES)
    return body


def _get(obj: Any, path: tuple) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def _raw(rng: random.Random, body: Any) -> bytes:
    """JSON text of ``body`` (NaN and infinities as Python writes them), sometimes broken on purpose."""
    text = json.dumps(body)
    broken = rng.random()
    if broken < 0.05:
        return text[: rng.randrange(1, max(2, len(text)))].encode()  # cut short
    if broken < 0.08:
        return (text[:-1] + ",}").encode()  # a trailing comma
    if broken < 0.10:
        return text.encode()[:10] + b"\xff\xfe" + text.encode()[10:]  # not UTF-8
    return text.encode()  # ASCII: json.dumps escapes every non-ASCII character, lone surrogates included


def fuzz_bodies(count: int, model: str, seed: int = 0) -> Iterator[Tuple[str, bytes, bool]]:
    """``count`` mutated bodies: ``(endpoint "chat" or "completion", raw JSON bytes, stream)``."""
    rng = random.Random(seed)
    seeds = seed_bodies(model)
    for _ in range(count):
        endpoint, body = seeds[rng.randrange(len(seeds))]
        body = copy.deepcopy(body)
        for _ in range(rng.randint(1, 2)):
            body = _mutate(rng, body) if isinstance(body, dict) else body
        stream = isinstance(body, dict) and body.get("stream") is True
        yield endpoint, _raw(rng, body), stream
