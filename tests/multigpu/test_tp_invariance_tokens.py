"""bf16 end to end on real gloo ranks: identical token ids and logprobs at tp 1, 2, 3, 4.

The requests are the README demo (``tpguide/engine/demo_requests.py``) and, when the
shared bench data is present, ``../shared/bench-data/vllm_fixtures.jsonl``;
each is run greedy (as written) and once more with seeded sampling, all in
one engine run per tp size.  The demo runs at tp 2, 3 and 4; the fixtures
(the ``slow`` set, without the demo again) at tp 4, the size that pads
both the heads and the vocabulary, against tp 1.  The engine is the default
one (grammar drafts for guided requests).  The
model is the tiny random Llama with SmolLM2's tokenizer (heads padded at tp 2
and 4); ``max_tokens`` is capped so one job per tp size stays short.  With
TP-invariant reductions the logits are bit-identical (``test_tp_invariance``),
so tokens and logprob values must be equal, not close.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tpguide.dist import TPGroup
from tpguide.dist.spawn import run_on_ranks
from tpguide.engine import EngineConfig, generate_on_group

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO.parent / "shared" / "bench-data" / "vllm_fixtures.jsonl"
MAX_TOKENS = 12
CONFIG = EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024, dtype=torch.bfloat16)


def _demo_requests() -> list:
    from tpguide.engine.demo_requests import DEMO_REQUESTS

    return [dict(r) for r in DEMO_REQUESTS]


def _with_sampled_copies(requests: list) -> list:
    out = []
    for i, r in enumerate(requests):
        greedy = {**r, "max_tokens": min(r.get("max_tokens", MAX_TOKENS), MAX_TOKENS), "logprobs": 1}
        greedy.setdefault("temperature", 0.0)
        sampled = {**greedy, "id": f"{r['id']}-sampled", "temperature": 0.8, "top_p": 0.95, "seed": 100 + i}
        out += [greedy, sampled]
    return out


def _outputs_key(outputs: list) -> list:
    return [(o["id"], o["finish_reason"], o["token_ids"], json.dumps(o.get("logprobs"))) for o in outputs]


@pytest.fixture(scope="module")
def demo():
    """The demo, greedy and sampled."""
    return _with_sampled_copies(_demo_requests())


@pytest.fixture(scope="module")
def vllm_fixtures():
    """The vLLM fixtures (not the demo again), greedy and sampled; skips when the shared bench data is absent."""
    if not FIXTURES.is_file():
        pytest.skip(f"{FIXTURES} not present")
    return _with_sampled_copies([json.loads(line) for line in FIXTURES.read_text().splitlines() if line.strip()])


@pytest.fixture(scope="module")
def demo_reference(tiny_model_path, demo):
    return generate_on_group(TPGroup(), tiny_model_path, demo, CONFIG)


@pytest.fixture(scope="module")
def vllm_fixtures_reference(tiny_model_path, vllm_fixtures):
    return generate_on_group(TPGroup(), tiny_model_path, vllm_fixtures, CONFIG)


def _check_identical(reference, tiny_model_path, requests, tp_size):
    results = run_on_ranks(generate_on_group, tp_size, tiny_model_path, requests, CONFIG)
    want = _outputs_key(reference)
    for rank_outputs in results:
        assert _outputs_key(rank_outputs) == want


@pytest.mark.parametrize("name", ["demo", pytest.param("vllm_fixtures", marks=pytest.mark.slow)])
def test_reference_generates(request, name):
    requests, reference = request.getfixturevalue(name), request.getfixturevalue(f"{name}_reference")
    assert len(reference) == len(requests)
    assert sum(len(o["token_ids"]) for o in reference) > 0
    assert any(o["id"].endswith("-sampled") and o["token_ids"] for o in reference)


@pytest.mark.parametrize("tp_size", [2, 3, 4])
def test_bf16_tokens_identical(demo_reference, tiny_model_path, demo, tp_size):
    _check_identical(demo_reference, tiny_model_path, demo, tp_size)


@pytest.mark.slow
def test_bf16_tokens_identical_on_the_vllm_fixtures_at_tp4(vllm_fixtures_reference, tiny_model_path, vllm_fixtures):
    _check_identical(vllm_fixtures_reference, tiny_model_path, vllm_fixtures, 4)


def _with_threads(threads: int, fn, *args):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(before)


def test_tp1_two_threads_equals_one_thread(demo_reference, tiny_model_path, demo):
    """tp 1 with 2 threads gives what tp 2-4 with 1 thread per rank give (``test_bf16_tokens_identical``)."""
    one = _with_threads(1, generate_on_group, TPGroup(), tiny_model_path, demo, CONFIG)
    two = _with_threads(2, generate_on_group, TPGroup(), tiny_model_path, demo, CONFIG)
    assert _outputs_key(two) == _outputs_key(one) == _outputs_key(demo_reference)


def _each_alone(model_dir: str, request_dicts: list) -> list:
    from tpguide.engine import build_engine
    from tpguide.engine.request_io import parse_request_lines

    engine = build_engine(TPGroup(), model_dir, CONFIG)
    outputs = []
    for r in request_dicts:
        (request,) = parse_request_lines([json.dumps(r)], 64)
        outputs += [o.to_json() for o in engine.generate([request])]
    engine.shutdown()
    return outputs


def test_each_request_alone_equals_in_the_file(demo_reference, tiny_model_path, demo):
    """Batched with the others or alone, a request gets the same tokens and logprobs."""
    assert _outputs_key(_each_alone(tiny_model_path, demo)) == _outputs_key(demo_reference)


@pytest.mark.parametrize("method", [None, "ngram", "draft-head"], ids=["no-drafts", "ngram", "draft-head"])
def test_speculation_equals_plain(demo_reference, tiny_model_path, demo, method):
    """Drafts verified in passes of 1 + K rows change nothing: the verify rows equal decode rows bit for bit.

    The reference runs the default engine (grammar drafts for guided requests); here no drafts at all,
    or n-gram / draft-head drafts behind the grammar's.
    """
    import dataclasses

    config = dataclasses.replace(CONFIG, speculative_method=method, num_speculative_tokens=4 if method else 0)
    assert _outputs_key(generate_on_group(TPGroup(), tiny_model_path, demo, config)) == _outputs_key(demo_reference)
