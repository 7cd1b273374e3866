"""Weights packed for the fixed-order CPU linear at engine start-up, so a process's first forward packs nothing."""

import torch

from tpguide.dist import TPGroup
from tpguide.engine import EngineConfig, build_engine
from tpguide.engine.request_io import request_from_dict
from tpguide.kernels.fixed_order_cpu import pack_weight
from tpguide.model.held_weights import is_released
from tpguide.model.invariant_reduce import prepack_weights
from tpguide.model.loader import load_model


def _packed(model):
    return {name: m._packed_weight for name, m in model.named_modules() if getattr(m, "_packed_weight", None)}


def test_engine_start_packs_every_fixed_order_weight_and_the_first_step_packs_none(tiny_model_path, monkeypatch):
    engine = build_engine(TPGroup(), tiny_model_path, EngineConfig(max_num_seqs=2, max_model_len=64))
    packed = _packed(engine.model)
    layer = engine.model.model.layers[0]
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        assert f"model.layers.0.{name}" in packed, sorted(packed)
    assert "lm_head" in packed and "model.embed_tokens" not in packed  # the tied head packs once, on the head
    assert packed["model.layers.0.self_attn.o_proj"].num_units == layer.self_attn.o_proj.num_local_units
    assert is_released(layer.mlp.down_proj.weight) and is_released(engine.model.model.embed_tokens.weight)  # once
    calls = []
    monkeypatch.setattr("tpguide.model.invariant_reduce.pack_weight", lambda *a: calls.append(a) or pack_weight(*a))
    out, = engine.generate([request_from_dict({"id": "a", "prompt": "Once upon", "max_tokens": 3}, 0, 64)])
    engine.shutdown()
    assert len(out.token_ids) == 3 and calls == []  # nothing packed in the first forward
    assert all(_packed(engine.model)[name] is p for name, p in packed.items())


def test_load_alone_packs_nothing_and_the_plain_mode_never_packs(tiny_model_path):
    assert _packed(load_model(tiny_model_path, TPGroup())) == {}  # a load's peak memory is the shard's
    plain = load_model(tiny_model_path, TPGroup(), tp_invariant=False)
    prepack_weights(plain)
    assert _packed(plain) == {}
    meta = load_model(tiny_model_path, TPGroup())
    meta.to(torch.device("meta"))
    prepack_weights(meta)  # off the CPU nothing is packed (and nothing raises)
    assert _packed(meta) == {}
