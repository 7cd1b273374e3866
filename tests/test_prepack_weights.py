"""Weights packed for the fixed-order CPU linear at load, so a process's first forward packs nothing."""

import torch

from tpguide.dist import TPGroup
from tpguide.model.attention import AttentionMetadata
from tpguide.kernels.fixed_order_cpu import pack_weight
from tpguide.model.loader import load_model


def _packed(model):
    return {name: m._packed_weight for name, m in model.named_modules() if getattr(m, "_packed_weight", None)}


def test_load_packs_every_fixed_order_weight_and_the_forward_reuses_them(tiny_model_path, monkeypatch):
    model = load_model(tiny_model_path, TPGroup())
    packed = _packed(model)
    layer = model.model.layers[0]
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        assert f"model.layers.0.{name}" in packed, sorted(packed)
    assert "lm_head" in packed and "model.embed_tokens" not in packed  # the tied head packs once, on the head
    assert packed["model.layers.0.self_attn.o_proj"].num_units == layer.self_attn.o_proj.num_local_units
    calls = []
    monkeypatch.setattr("tpguide.model.invariant_reduce.pack_weight", lambda *a: calls.append(a) or pack_weight(*a))
    model.allocate_kv_cache(4, 16, 64)
    meta = AttentionMetadata.from_block_tables([[0]], [5], [0], device=torch.device("cpu"), block_size=16)
    hidden = model(torch.tensor([1, 2, 3, 4, 5]), meta.token_positions, meta)
    model.compute_logits(hidden[-1:])
    assert calls == []  # nothing packed in the first forward
    assert all(_packed(model)[name] is p for name, p in packed.items())


def test_plain_mode_packs_nothing(tiny_model_path):
    assert _packed(load_model(tiny_model_path, TPGroup(), tp_invariant=False)) == {}
