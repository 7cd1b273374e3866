"""Each linear weight held once after start-up's packing, with outputs bit-identical to the two-copy path."""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from tpguide.dist import TPGroup
from tpguide.kernels.fixed_order_cpu import pack_weight
from tpguide.model.attention import AttentionMetadata
from tpguide.model.held_weights import is_released, packed_rows, resident_weight_bytes, unpack_weight
from tpguide.model.invariant_reduce import prepack_weights
from tpguide.model.loader import load_model, load_weights
from tpguide.model.random_checkpoint import write_random_checkpoint

IDS = torch.tensor([0, 31, 32, 700, 49151, 3, 9, 12345])  # panel edges, the last real id, a second request
POSITIONS = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])


def _run(model):
    """Hidden states and logits of two 4-token prefills (a fresh KV cache each time)."""
    model.allocate_kv_cache(4, 16)
    meta = AttentionMetadata.from_lists([0, 1], [4, 4], [4, 4])
    hidden = model(IDS, POSITIONS, meta)
    return hidden, model.compute_logits(hidden[[3, 7]])


def _param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def untied_path(tmp_path_factory, default_model_path):
    return str(write_random_checkpoint(tmp_path_factory.mktemp("untied"), tokenizer_dir=default_model_path,
                                       hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=96, tie_word_embeddings=False, seed=2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tied", [True, False])
def test_prepack_frees_the_checkpoint_layout_and_keeps_every_bit(tiny_model_path, untied_path, dtype, tied):
    path = tiny_model_path if tied else untied_path
    two_copies = load_model(path, TPGroup(), dtype)  # packs lazily in its forward, keeps the checkpoint layout
    want_hidden, want_logits = _run(two_copies)
    checkpoint = {name: p.detach().clone() for name, p in two_copies.named_parameters(remove_duplicate=False)}
    packed_bytes = sum(m.weight.numel() * m.weight.element_size() for m in two_copies.modules()
                       if getattr(m, "_packed_weight", None) is not None)
    assert resident_weight_bytes(two_copies) >= _param_bytes(two_copies) + packed_bytes  # a copy beside each

    model = load_model(path, TPGroup(), dtype)
    weights_before = _param_bytes(model)
    qkv = weakref.ref(model.model.layers[0].self_attn.qkv_proj.weight)
    prepack_weights(model)
    gc.collect()
    assert qkv() is None  # the checkpoint-layout tensor is gone, not only unreferenced by the module
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    for name, m in model.named_modules():
        packed = getattr(m, "_packed_weight", None)
        if packed is not None:
            assert is_released(m.weight) and m.weight.packed is packed and m.weight.device.type == "cpu", name
            assert torch.equal(unpack_weight(packed), checkpoint[f"{name}.weight"]), name
    assert is_released(model.model.embed_tokens.weight) == tied
    # each weight once: the packed panels add only their zero padding (32-column panels, k pairs)
    assert weights_before <= resident_weight_bytes(model) <= 1.01 * weights_before
    hidden, logits = _run(model)
    assert torch.equal(hidden, want_hidden) and torch.equal(logits, want_logits)
    prepack_weights(model)  # a second start-up on the same model packs and frees nothing more
    assert torch.equal(_run(model)[1], want_logits)


def test_a_released_weight_refuses_a_reload_and_plain_reads(tiny_model_path):
    model = load_model(tiny_model_path, TPGroup(), torch.bfloat16)
    prepack_weights(model)
    with pytest.raises(ValueError, match="released after packing"):
        load_weights(model, tiny_model_path)
    for read in (lambda w: F.linear(torch.ones(1, w.shape[1], dtype=w.dtype), w), lambda w: w.to(torch.float32),
                 lambda w: w.sum()):
        with pytest.raises(RuntimeError, match="held only packed"):  # no silent read of a data-less placeholder
            read(model.model.layers[0].mlp.down_proj.weight)


@pytest.mark.parametrize("isa", ["avx512", "avx512_bf16", "amx"])
def test_rows_and_whole_weight_read_back_from_every_packed_layout(isa, monkeypatch):
    weight = torch.randn(70, 40).to(torch.bfloat16)  # a partial last panel; K padded to 32 on AMX
    packed = pack_weight(weight, isa=isa)
    monkeypatch.setattr("tpguide.kernels.fixed_order_cpu.PACK_CHUNK_ROWS", 32)  # 3 passes of one panel
    assert torch.equal(pack_weight(weight, isa=isa).panels, packed.panels)
    ids = torch.tensor([69, 0, 31, 32, 33, 64, 5, 5])
    assert torch.equal(packed_rows(packed, ids), F.embedding(ids, weight))
    assert torch.equal(unpack_weight(packed), weight)
    units = pack_weight(weight, num_units=4, isa=isa)
    assert torch.equal(unpack_weight(units), weight)
    with pytest.raises(ValueError, match="num_units=4"):
        packed_rows(units, ids)
    with pytest.raises(IndexError, match=r"\[0, 70\]"):
        packed_rows(packed, torch.tensor([0, 70]))
