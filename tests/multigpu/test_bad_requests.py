"""Bad requests fail alone, with a message naming the problem, at tp 1 and tp 2.

Every bad-input class sits between good requests; the good ones
must give exactly the outputs of a run without the bad ones (greedy or
explicitly seeded, so a request's index does not change its tokens).
"""

import pytest

from tpguide.dist import TPGroup
from tpguide.dist.spawn import run_on_ranks
from tpguide.engine import EngineConfig, generate_on_group

CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
MAX_TOKENS = 8  # requests without max_tokens

GOOD = [
    {"id": "g-free", "prompt": "Once upon a time", "max_tokens": 6},
    {"id": "g-regex", "prompt": "code:", "structured_output": {"regex": r"[a-c]{2,4}-\d"}, "max_tokens": 8},
    {"id": "g-sampled", "prompt": "The sea", "max_tokens": 6, "temperature": 0.9, "seed": 7},
    {"id": "g-schema", "prompt": "JSON:", "max_tokens": 12,
     "structured_output": {"json": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                    "required": ["ok"]}}},
]
CYCLE = {"$ref": "#/$defs/node", "$defs": {"node": {
    "type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}}}
#: (request, words the error must contain)
BAD = [
    ({"id": "b-field", "prompt": "x", "colour": "red"}, ["unknown request field", "colour"]),
    ({"id": "b-schema", "prompt": "x", "structured_output": {"json": {"type": "nonsense"}}},
     ["not a valid JSON Schema", "nonsense", "(at /type)"]),
    ({"id": "b-contradiction", "prompt": "x",
      "structured_output": {"json": {"type": "integer", "minimum": 5, "maximum": 2}}}, ["minimum"]),
    ({"id": "b-cycle", "prompt": "x", "structured_output": {"json": CYCLE}},
     ["no finite instance", "$ref cycle", "#/$defs/node"]),
    ({"id": "b-regex", "prompt": "x", "structured_output": {"regex": "(unclosed"}}, ["regex", "parenthesis"]),
    ({"id": "b-ebnf", "prompt": "x", "structured_output": {"grammar": 'root ::= "a" |'}}, ["grammar", "EBNF"]),
    ({"id": "b-choice", "prompt": "x", "structured_output": {"choice": []}}, ["choice", "non-empty"]),
    ({"id": "b-empty", "prompt": ""}, ["prompt", "empty"]),
    ({"id": "b-blank", "prompt": "  \n "}, ["prompt", "whitespace"]),
    ({"id": "b-max0", "prompt": "x", "max_tokens": 0}, ["max_tokens", ">= 1", "0"]),
    ({"id": "b-maxbig", "prompt": "x", "max_tokens": 500}, ["max_tokens (500)", "max_model_len=64"]),
    ({"id": "b-temp", "prompt": "x", "temperature": -0.5}, ["temperature", "-0.5"]),
    ({"id": "b-long", "prompt": "word " * 80, "max_tokens": 2}, ["prompt (", "exceeds max_model_len=64"]),
]
MIXED = [GOOD[0], *[b for b, _ in BAD[:7]], GOOD[1], GOOD[2], *[b for b, _ in BAD[7:]], GOOD[3]]


@pytest.fixture(scope="module")
def clean_tp1(tiny_model_path):
    return generate_on_group(TPGroup(), tiny_model_path, GOOD, CONFIG, MAX_TOKENS)


def check_mixed(outputs, clean):
    assert [o["id"] for o in outputs] == [r["id"] for r in MIXED]  # one line per request, in order
    by_id = {o["id"]: o for o in outputs}
    for request, words in BAD:
        out = by_id[request["id"]]
        assert out["finish_reason"] == "error" and out["token_ids"] == [], out
        for word in words:
            assert word in out["error"], (request["id"], out["error"])
    for ref in clean:
        got = by_id[ref["id"]]
        assert got["finish_reason"] in ("stop", "length") and got["error"] is None
        assert (got["token_ids"], got["text"], got["finish_reason"]) == (
            ref["token_ids"], ref["text"], ref["finish_reason"])


def test_bad_requests_fail_alone_tp1(tiny_model_path, clean_tp1):
    check_mixed(generate_on_group(TPGroup(), tiny_model_path, MIXED, CONFIG, MAX_TOKENS), clean_tp1)


def test_bad_requests_fail_alone_tp2(tiny_model_path, clean_tp1):
    results = run_on_ranks(generate_on_group, 2, tiny_model_path, MIXED, CONFIG, MAX_TOKENS)
    for rank_outputs in results:
        check_mixed(rank_outputs, clean_tp1)
