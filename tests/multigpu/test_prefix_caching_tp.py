"""Prefix caching and preemption at tp 2 on real gloo ranks: the tokens and logprobs of tp 1 with caching off.

At tp 2 (KV heads padded from 3 to 4, two per rank; each rank holds its
heads' share of every block) an engine with prefix caching on and a KV pool
small enough to force preemptions runs the README demo (its requests share
the chat template's system prompt) and a multi-turn chat whose turns reuse
the previous turns' blocks; every output equals
the tp-1 run with caching off and the default-sized pool (bf16, TP-invariant).
"""

from __future__ import annotations

import dataclasses

import torch
from prefix_caching_testing import CACHING_OFF, CACHING_ON, chat_turns, outputs_key, run, with_sampled_copies

from tpguide.dist import TPGroup
from tpguide.dist import group as C
from tpguide.dist.spawn import run_on_ranks
from tpguide.engine import build_engine
from tpguide.engine.demo_requests import DEMO_REQUESTS
from tpguide.model.config import ModelConfig

BLOCKS = 16


def _demo() -> list:
    return [{**r, "max_tokens": 24} for r in with_sampled_copies([dict(r) for r in DEMO_REQUESTS])]


def _block_bytes(model_dir: str, tp_size: int, dtype: torch.dtype, block_size: int) -> int:
    cfg = ModelConfig.from_pretrained(model_dir)
    kv_heads = cfg.padded_heads(tp_size)[1] // tp_size
    return 2 * kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size() * block_size * cfg.num_hidden_layers


def _job(group, model_dir: str, config) -> tuple:
    engine = build_engine(group, model_dir, config)
    out = None
    if group.is_driver:
        demo = _demo()
        first, chat = run(engine, demo), chat_turns(engine)
        stats = engine.kv_cache_stats()
        out = (outputs_key(first), outputs_key(chat), stats.num_preemptions, stats.prefix_cache_hits)
        engine.shutdown()
    else:
        engine.run_worker()
    return C.broadcast_object(out, group)


def test_tp2_caching_and_preemption_equal_tp1_caching_off(tiny_model_path):
    reference = build_engine(TPGroup(), tiny_model_path, CACHING_OFF)
    want_demo, want_chat = outputs_key(run(reference, _demo())), outputs_key(chat_turns(reference))
    reference.shutdown()
    memory = BLOCKS * _block_bytes(tiny_model_path, 2, CACHING_ON.dtype, CACHING_ON.block_size)
    config = dataclasses.replace(CACHING_ON, kv_cache_memory=memory)
    for rank, (first, chat, preemptions, hits) in enumerate(run_on_ranks(_job, 2, tiny_model_path, config,
                                                                                  timeout_s=600)):
        assert preemptions > 0 and hits > 0, (rank, preemptions, hits)
        assert first == want_demo, rank
        assert chat == want_chat, rank
