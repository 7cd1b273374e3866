"""Prefix caching and preemption leave outputs unchanged (tp 1, the default bf16, tiny model).

Token ids and logprobs with prefix caching on equal those with it off: the
README demo (greedy and seeded-sampled) run twice on one engine (the second
pass hits the first's blocks), a multi-turn chat whose every turn extends the
last, the vLLM fixtures when the shared bench data is present, and runs whose
small ``kv_cache_memory`` forces preemptions.  A second request sharing a
1,000-token prefix prefills only its suffix (counted in prefilled tokens).
The multi-rank version is ``tests/multigpu/test_prefix_caching_tp.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from prefix_caching_testing import CACHING_OFF, CACHING_ON, chat_turns, outputs_key, run, with_sampled_copies

from tpguide.dist import TPGroup
from tpguide.engine import build_engine
from tpguide.engine.demo_requests import DEMO_REQUESTS

#: the shared bench data next to the checkout (``TPGUIDE_VLLM_FIXTURES`` overrides, e.g. from a git worktree)
FIXTURES = Path(os.environ.get("TPGUIDE_VLLM_FIXTURES",
                               Path(__file__).resolve().parents[1].parent / "shared" / "bench-data"
                               / "vllm_fixtures.jsonl"))
@pytest.fixture(scope="module")
def engine_off(tiny_model_path):
    engine = build_engine(TPGroup(), tiny_model_path, CACHING_OFF)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def engine_on(tiny_model_path):
    engine = build_engine(TPGroup(), tiny_model_path, CACHING_ON)
    yield engine
    engine.shutdown()


def _small_pool(tiny_model_path, config, blocks):
    probe = build_engine(TPGroup(), tiny_model_path, dataclasses.replace(config, max_num_seqs=1, max_model_len=16))
    block_bytes = probe.model.kv_cache_block_bytes(config.block_size)
    probe.shutdown()
    return build_engine(TPGroup(), tiny_model_path, dataclasses.replace(config, kv_cache_memory=blocks * block_bytes))


def test_demo_twice_with_caching_equals_caching_off(engine_off, engine_on):
    demo = with_sampled_copies([dict(r) for r in DEMO_REQUESTS])
    want = outputs_key(run(engine_off, demo))
    before = engine_on.kv_cache_stats()
    first = run(engine_on, demo)
    middle = engine_on.kv_cache_stats()
    second = run(engine_on, demo)
    after = engine_on.kv_cache_stats()
    assert outputs_key(first) == want
    assert outputs_key(second) == want
    assert after.prefix_cache_hits > middle.prefix_cache_hits >= before.prefix_cache_hits
    assert (after.num_prefill_tokens - middle.num_prefill_tokens) < (middle.num_prefill_tokens
                                                                     - before.num_prefill_tokens) / 2


def test_multi_turn_chat_with_caching_equals_caching_off(engine_off, engine_on):
    before = engine_on.kv_cache_stats().prefix_cache_hits
    assert outputs_key(chat_turns(engine_on)) == outputs_key(chat_turns(engine_off))
    assert engine_on.kv_cache_stats().prefix_cache_hits > before


def test_preemption_keeps_outputs(tiny_model_path, engine_off):
    """Preempted and recomputed with caching on (the caching-off recompute path is the same code
    minus the hits; tests/multigpu/test_prefix_caching_tp.py forces preemption at tp 2 too)."""
    demo = [{**r, "max_tokens": 24} for r in with_sampled_copies([dict(r) for r in DEMO_REQUESTS])]
    want = outputs_key(run(engine_off, demo))
    small = _small_pool(tiny_model_path, CACHING_ON, blocks=12)  # 14 requests of about 4-5 blocks each
    got = run(small, demo)
    chat = chat_turns(small)  # the chat's turns hit their previous turns' blocks
    assert outputs_key(chat) == outputs_key(chat_turns(engine_off))
    stats = small.kv_cache_stats()
    small.shutdown()
    assert stats.num_preemptions > 0
    assert outputs_key(got) == want


def test_second_request_with_a_shared_1000_token_prefix_prefills_only_its_suffix(engine_on):
    tok = engine_on.driver.tokenizer
    prefix = " ".join(f"item{i}" for i in range(400))
    assert len(tok(prefix)["input_ids"]) >= 1000
    first, second = ({"id": s, "prompt": f"{prefix} and then {s}", "max_tokens": 4} for s in ("alpha", "beta gamma"))
    run(engine_on, [first])
    before = engine_on.kv_cache_stats()
    (out,) = run(engine_on, [second])
    after = engine_on.kv_cache_stats()
    ids_first, ids_second = tok(first["prompt"])["input_ids"], tok(second["prompt"])["input_ids"]
    shared = next(i for i, (a, b) in enumerate(zip(ids_first, ids_second)) if a != b)
    assert shared >= 1000
    hit = shared // 16 * 16
    assert after.prefix_cache_hits - before.prefix_cache_hits == hit
    assert after.num_prefill_tokens - before.num_prefill_tokens == len(ids_second) - hit == out["num_prompt_tokens"] - hit


def test_a_request_longer_than_the_pool_is_refused_naming_the_numbers(tiny_model_path):
    small = _small_pool(tiny_model_path, CACHING_ON, blocks=4)
    (out,) = run(small, [{"id": "long", "prompt": "word " * 80, "max_tokens": 4}])
    small.shutdown()
    assert out["finish_reason"] == "error" and out["token_ids"] == []
    assert "KV blocks of 16 tokens, but the KV cache holds 4 blocks (64 tokens" in out["error"], out["error"]


def test_vllm_fixtures_with_caching_and_preemption_equal_caching_off(tiny_model_path, engine_off):
    if not FIXTURES.is_file():
        pytest.skip(f"{FIXTURES} not present")
    requests = [{**json.loads(line), "max_tokens": 6, "logprobs": 1}
                for line in FIXTURES.read_text().splitlines() if line.strip()]
    reference = run(engine_off, requests)
    want = outputs_key(reference)
    longest = max(-(-(o["num_prompt_tokens"] + 6) // 16) for o in reference)
    small = _small_pool(tiny_model_path, CACHING_ON, blocks=longest + 2)  # the longest fits, few run at once
    got = run(small, requests)
    stats = small.kv_cache_stats()
    small.shutdown()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert outputs_key(got) == want
