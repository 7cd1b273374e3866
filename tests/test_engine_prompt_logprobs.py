"""Prompt logprobs and per-token logprobs through the whole engine (one process, tiny model).

Chunked prefill must not change them, and they must agree with transformers'
``log_softmax`` of the same checkpoint.  Multi-rank equality lives in
``tests/multigpu/test_engine_logprobs.py``.
"""

import math

import pytest
import torch

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, generate_on_group

LONG = ("The quick brown fox jumps over the lazy dog, and then it runs across the wide green field "
        "toward the old river bank where the children play every summer.")
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
REQUESTS = [
    {"id": "long", "prompt": LONG, "prompt_logprobs": 3, "logprobs": 2, "max_tokens": 6},
    {"id": "guided", "prompt": "Answer in JSON:", "structured_output": {"json": SCHEMA}, "logprobs": 3,
     "max_tokens": 12, "prompt_logprobs": 1},
    {"id": "sampled", "prompt": "The sea is", "temperature": 0.8, "seed": 4, "logprobs": 1,
     "prompt_logprobs": 0, "max_tokens": 8},
    {"id": "one-token", "prompt": "Hi", "prompt_logprobs": 2, "max_tokens": 2},
    {"id": "plain", "prompt": "Once upon a time", "max_tokens": 4},
]
UNCHUNKED = EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=256)
CHUNK = 11  # the 31-token LONG prompt prefills in 3 chunks (11 + 11 + 9)
CHUNKED = EngineConfig(max_num_seqs=4, max_num_batched_tokens=CHUNK, max_model_len=256)
#: fp32 GEMMs of other shapes (chunks) round differently: a few ulp of logprobs of size ~5-15.
CHUNK_ATOL = 1e-5


@pytest.fixture(scope="module")
def unchunked(tiny_model_path):
    return {o["id"]: o for o in generate_on_group(TPGroup(), tiny_model_path, REQUESTS, UNCHUNKED)}


def _prompt_ids(tiny_model_path, text):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)(text)["input_ids"]


def test_prompt_logprobs_shape_and_tokens(unchunked, tiny_model_path):
    long = unchunked["long"]
    ids = _prompt_ids(tiny_model_path, LONG)
    assert math.ceil(len(ids) / CHUNK) == 3
    plp = long["prompt_logprobs"]
    assert len(plp) == long["num_prompt_tokens"] == len(ids) and plp[0] is None
    assert [e["token_id"] for e in plp[1:]] == ids[1:]
    assert all(len(e["top"]) == 3 and e["logprob"] <= 0 for e in plp[1:])
    assert all(e["top"][0][1] >= e["top"][1][1] >= e["top"][2][1] >= e["logprob"] or
               any(t[0] == e["token_id"] for t in e["top"]) for e in plp[1:])
    assert unchunked["one-token"]["prompt_logprobs"] == [None]
    assert all(len(e["top"]) == 0 for e in unchunked["sampled"]["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in unchunked["plain"] and "logprobs" not in unchunked["plain"]
    for o in unchunked.values():  # per-token logprobs: one entry per generated token, the token's own
        if "logprobs" in o:
            assert [e["token_id"] for e in o["logprobs"]] == o["token_ids"]


def test_chunked_prefill_gives_the_same_logprobs(unchunked, tiny_model_path):
    chunked = {o["id"]: o for o in generate_on_group(TPGroup(), tiny_model_path, REQUESTS, CHUNKED)}
    for rid, want in unchunked.items():
        got = chunked[rid]
        assert got["token_ids"] == want["token_ids"], rid
        for key in ("prompt_logprobs", "logprobs"):
            if key not in want:
                continue
            assert len(got[key]) == len(want[key])
            for g, w in zip(got[key], want[key]):
                if w is None:
                    assert g is None
                    continue
                assert g["token_id"] == w["token_id"]
                assert g["logprob"] == pytest.approx(w["logprob"], abs=CHUNK_ATOL), (rid, key)
                assert [t[0] for t in g["top"]] == [t[0] for t in w["top"]]
                assert [t[1] for t in g["top"]] == pytest.approx([t[1] for t in w["top"]], abs=CHUNK_ATOL)


def test_prompt_logprobs_agree_with_transformers(unchunked, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32).eval()
    ids = _prompt_ids(tiny_model_path, LONG)
    with torch.no_grad():
        lsm = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)  # [L, V]
    want = lsm[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor([e["logprob"] for e in unchunked["long"]["prompt_logprobs"][1:]], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    top = [e["top"] for e in unchunked["long"]["prompt_logprobs"][1:]]
    want_top = lsm[:-1].topk(3, dim=-1)
    assert [[t[0] for t in row] for row in top] == want_top.indices.tolist()
    torch.testing.assert_close(torch.tensor([[t[1] for t in row] for row in top], dtype=torch.float64),
                               want_top.values, rtol=0, atol=1e-4)


def test_prompt_logprobs_field_is_parsed_and_validated():
    from tpguide.engine.request_io import parse_request_lines

    ok, bad_value, bad_type = parse_request_lines(
        ['{"prompt": "x", "prompt_logprobs": 2}', '{"prompt": "x", "prompt_logprobs": 21}',
         '{"prompt": "x", "prompt_logprobs": true}'], 8)
    assert ok.sampling_params.prompt_logprobs == 2 and not ok.is_finished
    assert "prompt_logprobs must be null or an int in [0, 20], got 21" in bad_value.error
    assert bad_type.finish_reason == "error" and "True" in bad_type.error
    (off,) = parse_request_lines(['{"prompt": "x", "prompt_logprobs": null}'], 8)
    assert off.sampling_params.prompt_logprobs is None and not off.is_finished
