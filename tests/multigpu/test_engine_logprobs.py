"""Per-token and prompt logprobs on real gloo ranks equal the unsharded engine's.

Tokens and top-n ids are identical; logprob values agree to a few fp32 ulp,
not bit for bit: the sampler's normaliser is exact and partition-independent
(``tests/test_sampler.py`` and ``tests/test_prompt_logprobs.py`` check bit
identity for equal logits), but the model's row-parallel all-reduce sums the
partial products in another order at each tp_size, so the logits themselves
differ in the last bits.
"""

import pytest

from tpguide.dist import TPGroup
from tpguide.dist.spawn import run_on_ranks
from tpguide.engine import EngineConfig, generate_on_group

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
REQUESTS = [
    {"id": "long", "prompt": "The quick brown fox jumps over the lazy dog, and then it runs across the wide "
                             "green field.", "prompt_logprobs": 3, "logprobs": 2, "max_tokens": 6},
    {"id": "guided", "prompt": "Answer in JSON:", "structured_output": {"json": SCHEMA}, "logprobs": 3,
     "max_tokens": 12, "prompt_logprobs": 1},
    {"id": "sampled", "prompt": "The sea is", "temperature": 0.8, "seed": 4, "logprobs": 1,
     "prompt_logprobs": 0, "max_tokens": 8},
    {"id": "topk", "prompt": "Once upon a time", "temperature": 0.9, "top_k": 20, "seed": 5, "logprobs": 4,
     "max_tokens": 6},
]
CHUNKED = EngineConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=256)  # prompts in chunks

#: fp32 forward at another tp_size: logits differ by a few ulp (values of size ~5-15).
TP_ATOL = 2e-5


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    return generate_on_group(TPGroup(), tiny_model_path, REQUESTS, CHUNKED)


def _assert_close_logprobs(got, want):
    for key in ("logprobs", "prompt_logprobs"):
        assert (key in got) == (key in want), key
        for g, w in zip(got.get(key) or [], want.get(key) or [], strict=True):
            if w is None:
                assert g is None
                continue
            assert g["token_id"] == w["token_id"]
            assert g["logprob"] == pytest.approx(w["logprob"], abs=TP_ATOL), (got["id"], key)
            assert [t[0] for t in g["top"]] == [t[0] for t in w["top"]]
            assert [t[1] for t in g["top"]] == pytest.approx([t[1] for t in w["top"]], abs=TP_ATOL)


@pytest.mark.parametrize("tp_size", [2, 3])
def test_logprobs_equal_unsharded(reference, tiny_model_path, tp_size):
    results = run_on_ranks(generate_on_group, tp_size, tiny_model_path, REQUESTS, CHUNKED)
    for rank_outputs in results:  # every rank returns the driver's outputs
        for got, want in zip(rank_outputs, reference, strict=True):
            assert got["token_ids"] == want["token_ids"], got["id"]
            _assert_close_logprobs(got, want)
