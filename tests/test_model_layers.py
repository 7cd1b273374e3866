"""Shard-by-hand tests of the TP layers, in one process.

Each test builds rank ``r``'s layer for ``r = 0..T-1`` with a fake group (a
sentinel ``process_group``: no collective is ever called, because the tests
use the layers' communication-free parts or ``reduce_results=False``),
combines the shards by hand (concatenate or sum) and compares with the
unsharded computation.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tpguide.dist import TPGroup
from tpguide.model.attention import AttentionMetadata
from tpguide.model.config import ModelConfig, pad_heads
from tpguide.model.llama import LlamaAttention, LlamaMLP
from tpguide.model.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tpguide.model.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from tpguide.model.weight_slice import copy_clipped_

TP_SIZES = [1, 2, 3, 4]


def fake_group(tp_rank: int, tp_size: int) -> TPGroup:
    """A group whose collectives must not be called (sentinel process group)."""
    return TPGroup(tp_rank=tp_rank, tp_size=tp_size, process_group=None if tp_size == 1 else object())


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_pad_heads_smollm2_layout():
    assert pad_heads(9, 3, 1) == (9, 3)
    assert pad_heads(9, 3, 2) == (12, 4)
    assert pad_heads(9, 3, 3) == (9, 3)
    assert pad_heads(9, 3, 4) == (12, 4)
    assert pad_heads(32, 8, 16) == (64, 16)


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_column_and_merged_concatenate_to_full(tp_size):
    x, w, gate, up = randn(5, 12), randn(24, 12, seed=1), randn(24, 12, seed=2), randn(24, 12, seed=3)
    col, merged = [], []
    for r in range(tp_size):
        layer = ColumnParallelLinear(12, 24, fake_group(r, tp_size))
        layer.weight.weight_loader(layer.weight, w)
        col.append(layer(x))
        m = MergedColumnParallelLinear(12, [24, 24], fake_group(r, tp_size))
        m.weight.weight_loader(m.weight, gate, 0)
        m.weight.weight_loader(m.weight, up, 1)
        merged.append(m(x).chunk(2, dim=-1))  # this rank's (gate, up) columns
    torch.testing.assert_close(torch.cat(col, -1), x @ w.T)
    torch.testing.assert_close(torch.cat([g for g, _ in merged], -1), x @ gate.T)
    torch.testing.assert_close(torch.cat([u for _, u in merged], -1), x @ up.T)


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_qkv_padded_heads_are_zero_and_real_heads_match(tp_size):
    hidden, d, h, kv = 16, 4, 9, 3
    x = randn(6, hidden)
    wq, wk, wv = randn(h * d, hidden, seed=1), randn(kv * d, hidden, seed=2), randn(kv * d, hidden, seed=3)
    bq, bk, bv = randn(h * d, seed=4), randn(kv * d, seed=5), randn(kv * d, seed=6)
    qs, ks, vs = [], [], []
    for r in range(tp_size):
        layer = QKVParallelLinear(hidden, d, h, kv, fake_group(r, tp_size), bias=True)
        for sid, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
            layer.weight.weight_loader(layer.weight, w, sid)
            layer.bias.weight_loader(layer.bias, b, sid)
        q, k, v = layer.split(layer(x))
        assert q.shape[1] == k.shape[1] * (h // kv)  # whole KV groups per rank
        qs.append(q), ks.append(k), vs.append(v)
    hp, kvp = pad_heads(h, kv, tp_size)
    q, k, v = torch.cat(qs, 1), torch.cat(ks, 1), torch.cat(vs, 1)  # [N, Hp, D], [N, Kp, D]
    assert q.shape[1] == hp and k.shape[1] == kvp
    torch.testing.assert_close(q[:, :h], (x @ wq.T + bq).unflatten(-1, (h, d)))
    torch.testing.assert_close(k[:, :kv], (x @ wk.T + bk).unflatten(-1, (kv, d)))
    torch.testing.assert_close(v[:, :kv], (x @ wv.T + bv).unflatten(-1, (kv, d)))
    assert (q[:, h:] == 0).all() and (k[:, kv:] == 0).all() and (v[:, kv:] == 0).all()


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_row_parallel_partials_sum_to_full_and_ignore_padding(tp_size):
    real_in, out = 36, 10
    padded_in = pad_heads(9, 3, tp_size)[0] * 4  # 9 heads of dim 4, padded
    x = randn(5, padded_in)  # padded columns hold garbage: their weights must be zero
    w, b = randn(out, real_in, seed=1), randn(out, seed=2)
    per = padded_in // tp_size
    total = 0
    for r in range(tp_size):
        layer = RowParallelLinear(padded_in, out, fake_group(r, tp_size), bias=True,
                                  reduce_results=False, org_input_size=real_in)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        total = total + layer(x[:, r * per:(r + 1) * per])
    torch.testing.assert_close(total, x[:, :real_in] @ w.T + b)


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("org_vocab_size", [1000, 1031])
def test_vocab_parallel_embedding_and_lm_head(tp_size, org_vocab_size):
    dim = 8
    w = randn(org_vocab_size, dim)
    ids = torch.tensor([0, 1, org_vocab_size - 1, 517, 64, 999])
    hidden = randn(3, dim, seed=7)
    emb_sum, shards = 0, []
    for r in range(tp_size):
        g = fake_group(r, tp_size)
        emb = VocabParallelEmbedding(org_vocab_size, dim, g)
        emb.weight.weight_loader(emb.weight, w)
        emb_sum = emb_sum + emb.local_embedding(ids)
        head = ParallelLMHead(org_vocab_size, dim, g, tokenizer_vocab_size=990)
        head.weight.weight_loader(head.weight, w)
        assert head.vocab_shard.vocab_start_index == r * head.vocab_shard.num_embeddings_per_partition
        shards.append(head.compute_logits(hidden))
    torch.testing.assert_close(emb_sum, F.embedding(ids, w))
    logits = torch.cat(shards, -1)
    assert logits.dtype == torch.float32
    assert logits.shape[1] == head.vocab_shard.padded_vocab_size
    torch.testing.assert_close(logits[:, :990], hidden @ w[:990].T)
    assert torch.isneginf(logits[:, 990:]).all()


def test_weight_loader_reads_lazy_safetensors_slice(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    w = randn(36, 16)
    save_file({"w": w}, str(tmp_path / "x.safetensors"))
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        for r in range(4):
            layer = QKVParallelLinear(16, 4, 9, 3, fake_group(r, 4))
            layer.weight.weight_loader(layer.weight, f.get_slice("w"), "q")
            ref = QKVParallelLinear(16, 4, 9, 3, fake_group(r, 4))
            ref.weight.weight_loader(ref.weight, w, "q")
            assert torch.equal(layer.weight, ref.weight)
    dst = torch.full((4, 3), 7.0)
    copy_clipped_(dst, torch.ones(5, 3), 0, 3)  # rows 3, 4 real, rest zeroed
    assert dst.tolist() == [[1.0] * 3, [1.0] * 3, [0.0] * 3, [0.0] * 3]


def test_weight_loader_names_both_shapes():
    layer = ColumnParallelLinear(12, 8, fake_group(0, 1))
    with pytest.raises(ValueError, match=r"\[8, 11\].*\[8, 12\]"):
        layer.weight.weight_loader(layer.weight, torch.zeros(8, 11))


def _tiny_config(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", hidden_size=24, intermediate_size=48, num_hidden_layers=1,
                num_attention_heads=9, num_key_value_heads=3, head_dim=4, rms_norm_eps=1e-6,
                max_position_embeddings=64, org_vocab_size=100, attention_bias=True, o_proj_bias=True,
                mlp_bias=True)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("tp_size", [2, 3, 4])
def test_attention_and_mlp_blocks_sum_to_unsharded(tp_size):
    cfg = _tiny_config()
    h, kv, d, hid, inter = 9, 3, 4, 24, 48
    full = {
        ("qkv_proj.weight", "q"): randn(h * d, hid, seed=1), ("qkv_proj.weight", "k"): randn(kv * d, hid, seed=2),
        ("qkv_proj.weight", "v"): randn(kv * d, hid, seed=3), ("qkv_proj.bias", "q"): randn(h * d, seed=4),
        ("qkv_proj.bias", "k"): randn(kv * d, seed=5), ("qkv_proj.bias", "v"): randn(kv * d, seed=6),
        ("o_proj.weight", None): randn(hid, h * d, seed=7), ("o_proj.bias", None): randn(hid, seed=8),
    }
    mlp_full = {
        ("gate_up_proj.weight", 0): randn(inter, hid, seed=9), ("gate_up_proj.weight", 1): randn(inter, hid, seed=10),
        ("gate_up_proj.bias", 0): randn(inter, seed=11), ("gate_up_proj.bias", 1): randn(inter, seed=12),
        ("down_proj.weight", None): randn(hid, inter, seed=13), ("down_proj.bias", None): randn(hid, seed=14),
    }
    meta = AttentionMetadata.from_lists([0, 1], [5, 3], [0, 0])
    x, positions = randn(8, hid, seed=15), meta.token_positions

    def run(group):
        # plain reductions: the partial sums are added by hand (the invariant path: tests/multigpu/test_tp_invariance.py)
        plain = dataclasses.replace(cfg, tp_invariant=False)
        attn = LlamaAttention(plain, group, torch.float32)
        mlp = LlamaMLP(plain, group, torch.float32)
        for module, tensors in ((attn, full), (mlp, mlp_full)):
            for (name, sid), t in tensors.items():
                p = module.get_parameter(name)
                p.weight_loader(p, t, sid)
        attn.o_proj.reduce_results = mlp.down_proj.reduce_results = False  # sum by hand below
        cache = (2, 16, attn.qkv_proj.num_kv_heads, d)
        attn.attn.k_cache, attn.attn.v_cache = torch.zeros(cache), torch.zeros(cache)
        return attn(positions, x, meta), mlp(x)

    ref_attn, ref_mlp = run(fake_group(0, 1))
    outs = [run(fake_group(r, tp_size)) for r in range(tp_size)]
    torch.testing.assert_close(sum(a for a, _ in outs), ref_attn, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sum(m for _, m in outs), ref_mlp, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("tp_size", [1, 2, 3, 4])
def test_invariant_row_parallel_unit_partials_are_the_tp1_units(tp_size):
    """Each rank's fp32 unit partials are exactly the tp-1 ones; padded units are zero and dropped."""
    from tpguide.model.invariant_reduce import unit_partials

    heads, d, out = 9, 4, 24
    padded = pad_heads(heads, 3, tp_size)[0]
    w, x = randn(out, heads * d, seed=21), randn(5, padded * d, seed=22)
    x[:, heads * d:] = 0.0  # padded heads' attention output

    def partials(r):
        layer = RowParallelLinear(padded * d, out, fake_group(r, tp_size), org_input_size=heads * d,
                                  reduction_unit=d)
        layer.weight.weight_loader(layer.weight, w)
        n = layer.input_size_per_partition
        return layer, unit_partials(x[:, r * n:(r + 1) * n], layer.weight, layer.num_local_units, layer)

    layer, ref = partials(0) if tp_size == 1 else (None, torch.cat([partials(r)[1] for r in range(tp_size)]))
    full = RowParallelLinear(heads * d, out, fake_group(0, 1), reduction_unit=d)
    full.weight.weight_loader(full.weight, w)
    want = unit_partials(x[:, :heads * d], full.weight, heads, full)
    assert torch.equal(ref[:heads], want)
    assert not ref[heads:].any()
    torch.testing.assert_close(full(x[:, :heads * d]), x[:, :heads * d] @ w.T, atol=1e-5, rtol=1e-5)


def test_invariant_row_parallel_rejects_bad_units():
    with pytest.raises(ValueError, match="reduction_unit=5"):
        RowParallelLinear(24, 8, fake_group(0, 2), reduction_unit=5)
    with pytest.raises(ValueError, match="reduce_results"):
        RowParallelLinear(24, 8, fake_group(0, 2), reduction_unit=4, reduce_results=False)


def test_reduction_block_size_puts_every_shard_boundary_on_a_block_boundary():
    from tpguide.model.invariant_reduce import reduction_block_size

    assert reduction_block_size(1536, 1) == 128  # SmolLM2-135M: 12 units
    assert reduction_block_size(192, 4) == 16
    assert reduction_block_size(1536, 8) == 64  # outside (1, 2, 3, 4): a smaller block
    with pytest.raises(ValueError, match="tp_size=5"):
        reduction_block_size(1536, 5)
