"""The one-launch RoPE kernel against its plain-torch oracle (the model's torch path), bit for bit.

On CPU the kernel runs under ``TRITON_INTERPRET=1`` in a child process
(``tests/triton_interpreted.py``); with a GPU the cases also run compiled.
Checks, integer views: float32, bfloat16 and float16; full rotary (Llama)
and partial rotary (Phi-3's 3/4); q and k as strided views of one fused QKV
output, as the model hands them; a token alone equals the token among
others; :class:`~tpguide.model.rotary.RotaryEmbedding` on the forced CUDA
path equals its torch path; the errors it raises.

Run directly with ``TRITON_INTERPRET=1 python tests/test_kernels_rotary_triton.py [NAME...]``.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreted import check_in_child, run_cases

pytest.importorskip("triton")


def _same_bits(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[got.dtype]
    assert torch.equal(got.cpu().view(view), want.cpu().view(view))


def _inputs(dtype, tokens, heads, kv_heads, head_dim, rotary_dim, device, seed):
    """q, k views of one ``[T, (H + 2 Hkv) * D]`` QKV output and a table ``cos``, ``sin`` ``[T, 1, R]``."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 3).to(dtype).to(device)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    angle = torch.rand(tokens, 1, rotary_dim // 2, generator=g, dtype=torch.float64) * 1000
    angle = torch.cat((angle, angle), dim=-1)
    return q, k, angle.cos().to(dtype).to(device), angle.sin().to(dtype).to(device)


def _kernel(dtype, heads, kv_heads, head_dim, rotary_dim):
    def case(device):
        from tpguide.kernels.rotary_triton import rotary_triton
        from tpguide.model.rotary import apply_rotary
        q, k, cos, sin = _inputs(dtype, 7, heads, kv_heads, head_dim, rotary_dim, device, seed=head_dim + rotary_dim)
        q_rot, k_rot = rotary_triton(q, k, cos, sin)
        assert q_rot.is_contiguous() and k_rot.is_contiguous()
        _same_bits(q_rot, apply_rotary(q, cos, sin))
        _same_bits(k_rot, apply_rotary(k, cos, sin))
        for rows in ([6], [2, 5]):  # a token alone or beside another: the same bits
            q1, k1 = rotary_triton(q[rows], k[rows], cos[rows], sin[rows])
            _same_bits(q1, q_rot[rows])
            _same_bits(k1, k_rot[rows])
    return case


def _module(arch):
    """RotaryEmbedding of a tiny config on the CUDA code path (forced on CPU) equals its torch formula, position -1 too."""
    def case(device):
        import contextlib

        from tpguide.kernels.triton_path import forced_triton_path
        from tpguide.model.config import ModelConfig
        from tpguide.model.random_checkpoint import tiny_hf_config
        from tpguide.model.rotary import RotaryEmbedding, apply_rotary
        config = ModelConfig.from_hf(tiny_hf_config(arch, 64))
        rope = RotaryEmbedding(config).to(device)
        d = config.head_dim
        q, k, _, _ = _inputs(torch.bfloat16, 5, 4, 2, d, d, device, seed=3)
        positions = torch.tensor([0, 7, 31, -1, 100], device=device)
        cos, sin = rope.cos_sin(positions, q.dtype)
        assert cos.shape[-1] == rope.rotary_dim <= d
        with forced_triton_path() if device == "cpu" else contextlib.nullcontext():
            got = rope(positions, q, k)
        _same_bits(got[0], apply_rotary(q, cos, sin))
        _same_bits(got[1], apply_rotary(k, cos, sin))
    return case


def _cache_write(dtype, rotary_dim):
    """rotary_and_cache_write_triton = rotary_triton then write_kv_cache_: q, and both pools, bit for bit."""
    def case(device):
        from tpguide.kernels.kv_cache_write_triton import write_kv_cache_
        from tpguide.kernels.rotary_triton import rotary_and_cache_write_triton, rotary_triton
        q, k, cos, sin = _inputs(dtype, 5, 6, 2, 32, rotary_dim, device, seed=rotary_dim)
        v = (torch.randn(5, 2, 32, generator=torch.Generator().manual_seed(9)) * 2).to(dtype).to(device)
        slots = torch.tensor([11, -1, 3, 20, -1], device=device)  # two padding tokens write nothing
        pools = [torch.full((4, 8, 2, 32), 7.0, dtype=dtype, device=device) for _ in range(4)]
        q_want, k_rot = rotary_triton(q, k, cos, sin)
        write_kv_cache_(k_rot, v, pools[0], pools[1], slots)
        q_got = rotary_and_cache_write_triton(q, k, v, cos, sin, pools[2], pools[3], slots)
        _same_bits(q_got, q_want)
        _same_bits(pools[2], pools[0])
        _same_bits(pools[3], pools[1])
        flat = pools[2].view(32, 2, 32)
        _same_bits(flat[[11, 3, 20]], k_rot[[0, 2, 3]])
        assert int((pools[2] != 7.0).any(dim=(2, 3)).sum()) == 3  # the 3 real tokens' rows, nothing else
    return case


def _attention_paths(device):
    """Attention.forward_rotary (the fused launch) = rotary_triton then Attention.forward: output and pool bits."""
    import contextlib
    import tempfile
    from pathlib import Path

    from tpguide.dist import TPGroup
    from tpguide.kernels.rotary_triton import rotary_triton
    from tpguide.kernels.triton_path import forced_triton_path
    from tpguide.model.attention import AttentionMetadata
    from tpguide.model.loader import load_model
    from tpguide.model.random_checkpoint import tiny_hf_config, write_random_model

    d = write_random_model(Path(tempfile.mkdtemp()), tiny_hf_config("LlamaForCausalLM", 64), seed=2)
    model = load_model(d, TPGroup(device=torch.device(device)), dtype=torch.bfloat16)
    model.allocate_kv_cache(8, 8, max_model_len=32)
    layer = model.model.layers[0].self_attn
    attn, heads, kv_heads, dim = layer.attn, layer.attn.num_heads, layer.attn.num_kv_heads, layer.attn.head_dim
    meta = AttentionMetadata.from_block_tables([[3, 1], [6]], [5, 2], [4, 0], device=device, block_size=8)
    q, k, cos, sin = _inputs(torch.bfloat16, 7, heads, kv_heads, dim, dim, device, seed=8)
    v = k.clone() * 0.5
    with forced_triton_path() if device == "cpu" else contextlib.nullcontext():
        cos, sin = layer.rotary_emb.cos_sin(meta.token_positions, q.dtype)
        assert attn.fuses_rotary(q)
        fused = attn.forward_rotary(q, k, v, cos, sin, meta)
        pools = attn.k_cache.clone(), attn.v_cache.clone()
        attn.k_cache.zero_()
        attn.v_cache.zero_()
        q_rot, k_rot = rotary_triton(q, k, cos, sin)
        split = attn(q_rot, k_rot, v, meta)
    _same_bits(fused, split)
    _same_bits(attn.k_cache, pools[0])
    _same_bits(attn.v_cache, pools[1])


def _errors(device):
    from tpguide.kernels.rotary_triton import rotary_triton
    q, k, cos, sin = _inputs(torch.bfloat16, 3, 2, 1, 8, 8, device, seed=1)
    for args, words in (((q[0], k, cos, sin), "q \\[T, H, D\\]"), ((q, k[:2], cos, sin), "k \\[T, Hkv, D\\]"),
                        ((q, k, cos[..., :3], sin[..., :3]), "R even"), ((q, k, cos.float(), sin), "one dtype"),
                        ((q.double(), k.double(), cos.double(), sin.double()), "one dtype"),
                        ((q.transpose(1, 2).contiguous().transpose(1, 2), k, cos, sin), "unit last stride")):
        with pytest.raises(ValueError, match=words):
            rotary_triton(*args)
    from tpguide.kernels.rotary_triton import rotary_and_cache_write_triton
    pool = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16, device=device)
    slots = torch.arange(3, device=device)
    v = k.contiguous()
    for args, words in (((k[:2], pool, pool, slots), "need v"), ((v, pool[..., :4], pool[..., :4], slots), "caches"),
                        ((v, pool, pool, slots.float()), "slot_mapping"),
                        ((v, pool.float(), pool.float(), slots), "k's dtype")):
        with pytest.raises(ValueError, match=words):
            rotary_and_cache_write_triton(q, k, args[0], cos, sin, *args[1:])
    empty = rotary_triton(q[:0], k[:0], cos[:0], sin[:0])
    assert [tuple(x.shape) for x in empty] == [(0, 2, 8), (0, 1, 8)]


CASES = {
    **{f"kernel_{dt}_{h}x{kv}x{d}_r{r}": _kernel(getattr(torch, dt), h, kv, d, r)
       for dt, h, kv, d, r in (("bfloat16", 9, 3, 64, 64), ("float32", 9, 3, 64, 64), ("float16", 4, 2, 32, 32),
                               ("bfloat16", 4, 2, 32, 24), ("float32", 3, 1, 96, 72), ("bfloat16", 2, 2, 80, 80))},
    "cache_write_bf16": _cache_write(torch.bfloat16, 32),
    "cache_write_f32_partial": _cache_write(torch.float32, 24),
    "attention_paths": _attention_paths,
    "module_llama": _module("LlamaForCausalLM"),
    "module_phi3": _module("Phi3ForCausalLM"),
    "errors": _errors,
}


def test_rotary_interpreted_on_cpu():
    check_in_child(__file__, list(CASES))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_rotary_cuda(name):
    CASES[name]("cuda")


if __name__ == "__main__":
    run_cases(CASES)
