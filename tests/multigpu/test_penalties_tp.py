"""Penalties, logit_bias and stop strings through the whole engine: identical tokens at tp 1, 2 and 3 (gloo).

Negative penalties (the random test model never repeats a token by itself) make each one bite.
Each penalty is applied to each rank's own logits shard; the outputs must
equal the unsharded run token for token, and each must change the output
of the same request without it (so the test cannot pass by ignoring it).
"""

import pytest

from tpguide.dist.spawn import run_at_tp_size
from tpguide.engine import EngineConfig, generate_on_group

CONFIG = EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=128)
BASE = {"prompt": "The cat sat on the", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, "logprobs": 1}
REQUESTS = [
    dict(BASE, id="plain"),
    dict(BASE, id="presence", presence_penalty=-2.0),
    dict(BASE, id="frequency", frequency_penalty=-2.0),
    dict(BASE, id="repetition", repetition_penalty=0.2),
    dict(BASE, id="seeded", temperature=0.8, seed=3, frequency_penalty=1.0, repetition_penalty=1.2),
]


def run(group, model_dir, requests):
    return generate_on_group(group, model_dir, requests, CONFIG)


@pytest.fixture(scope="module")
def unsharded(tiny_model_path):
    outs = run_at_tp_size(run, 1, tiny_model_path, REQUESTS + [_biased(tiny_model_path)])[0]
    return {o["id"]: o for o in outs}


def _biased(tiny_model_path):
    """logit_bias -100 on the plain request's first token (found by running it once)."""
    first = run_at_tp_size(run, 1, tiny_model_path, [dict(BASE, id="p", max_tokens=1)])[0][0]["token_ids"][0]
    return dict(BASE, id="bias", logit_bias={str(first): -100.0})


def test_each_penalty_changes_the_output(unsharded):
    """Tokens change (repetition, bias); presence/frequency at least change the distributions (logprobs)."""
    plain = unsharded["plain"]
    for rid in ("presence", "frequency", "repetition", "bias"):
        assert unsharded[rid]["finish_reason"] == "length", unsharded[rid]
        assert unsharded[rid]["logprobs"] != plain["logprobs"], rid
    for rid in ("repetition", "bias"):
        assert unsharded[rid]["token_ids"] != plain["token_ids"], rid
    assert unsharded["bias"]["token_ids"][0] != plain["token_ids"][0]


@pytest.mark.parametrize("tp_size", [2, 3])
def test_sharded_penalties_give_the_unsharded_tokens(tiny_model_path, unsharded, tp_size):
    requests = REQUESTS + [_biased(tiny_model_path)]
    for outs in run_at_tp_size(run, tp_size, tiny_model_path, requests):
        for o in outs:
            assert o["token_ids"] == unsharded[o["id"]]["token_ids"], (tp_size, o["id"])


def test_stop_string_cuts_the_text(tiny_model_path, unsharded):
    plain = unsharded["plain"]
    stop = plain["text"][len(plain["text"]) // 2:][:3]
    assert stop.strip(), plain["text"]
    (out,) = run_at_tp_size(run, 2, tiny_model_path, [dict(BASE, id="stop", stop=[stop])])[0]
    assert out["finish_reason"] == "stop" and out["text"] == plain["text"][:plain["text"].find(stop)]
    assert out["token_ids"] == plain["token_ids"][:len(out["token_ids"])]
    assert len(out["token_ids"]) < len(plain["token_ids"])
